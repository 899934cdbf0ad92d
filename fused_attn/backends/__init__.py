"""Attention backends. Each backend module exposes the same four functions:

    can_serve(problem) -> Optional[str]      None if it can run the problem, else the reason
    forward(problem) -> (out, lse, saved)    no autograd; out in the query's format,
                                             lse fp32 (B, H, Sq) dense / (H, Tq) thd,
                                             saved: backend-private tensor for backward
    backward(problem, out, saved, grad_out) -> (dq, dk, dv)   same shapes/layouts as inputs
    attention(problem) -> (out, lse)         autograd-aware eager entry point

Backends never import each other; `fused_attn.functional` picks one.
"""
