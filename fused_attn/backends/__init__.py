"""The attention engines, each behind the engine contract of `fused_attn.engines` (an engine's
refusal of a problem, its runner: forward, backward, backward_with_lse):

    reference.py, reference_engine.py     pure PyTorch math: the semantics and the test oracle
    torch_engine.py, torch_sdpa.py, torch_flex.py     torch's own CPU kernels
    cudnn/                                cuDNN frontend graphs

Engines never import each other; `fused_attn.engines` chooses one per call plan.
"""
