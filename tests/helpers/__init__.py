"""Shared test helpers, importable from every test folder (`tests/` is on the path: pytest puts the
directory of the root conftest there): `from helpers.attention import rand, band_mask`.

attention       seeded inputs, masks, cu_seqlens and the packed-sequence views (oracles in plain torch)
mods            score_mods and ScoreMod subclasses several test files exercise
zoo             attention-gym style mods with independent plain-torch oracles
gym_oracles     attention-gym's definitions in plain torch (the oracles of score_mods.gym)
gym_cases       the cases of score_mods.gym (sizes, tables, parametrization)
cudnn_stub      a stub cuDNN executor (real graph construction, no GPU)
fake_cases      every public entry point, callable on fake / meta tensors
compile_cases   a tiny transformer block and the compiled-bias check shared with the GPU suite
hf_models       tiny transformers models, batches and the model-level comparison
padding_cases   padded batches with poisoned padding
dist_cases, cp_cases    cases run inside spawned gloo groups (tests/distributed)
store_worker, persistent_child, quirk_probes    code run in child processes
stub_engines    a base for stub engines plugged into fused_attn.engines
fa4_gpu_cases   seeded inputs per layout and one backend run, for the FA4 GPU test files
cuda_isolation  a pytest plugin for GPU runs (`-p helpers.cuda_isolation`)
gpu_spread      a pytest plugin that gives each xdist worker one of several GPUs (`-p helpers.gpu_spread --gpus N`)

No helper imports a test file; no test file imports another test file.
"""
