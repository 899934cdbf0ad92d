"""The flash-attn-4 engine (CuTe DSL kernels, an optional extra): `engine` (the contract),
`support` (what it runs, from metadata), `runner` (the calls into FA4), `cute_source` /
`cute_load` (score_mods lowered to CuTe callables), `install` (package, version, GPU)."""
