"""The contracts between Hydra's processes, declared once and imported by both sides.

No torch here: the console imports these without loading the engine.
- `split`: the layer-split grammar (`--split`, the split editor, CONFIGURE).
- `status`: the `/health` and `/status` documents, parsed once into typed objects.
- `rpc`: the merged RPC port's bytes: framing, command ids, capability bits, per-command layouts.
- `framing`: the control protocol's framing and the frame readers (head, PREFILL client, console).
- `gguf_header`: a GGUF's metadata and tensor table (the split editor's model shape, the engine's `GGUFFile`).
- `footprint`, `slot_state`, `auth`, `errors`, `default_model`: see docs/ARCHITECTURE.md.
"""
