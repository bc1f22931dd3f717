"""The contracts between Hydra's processes, declared once and imported by both sides.

No torch here: the console imports these without loading the engine.
- `split`: the layer-split grammar (`--split`, the split editor, CONFIGURE).
- `status`: the `/health` and `/status` documents, parsed once into typed objects.
- `rpc`: the merged RPC port's bytes: framing, command ids, capability bits, per-command layouts.
"""
