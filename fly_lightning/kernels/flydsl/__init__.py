"""FlyDSL kernels for AMD gfx950 (MI350). Compile-verified here (no AMD GPU): see ``NOTES.md`` in this folder.

Modules starting with ``_`` hold the kernels themselves and import no fly_lightning code but the output allocator
``kernels/outputs.py`` (which imports only torch), so the compile child (``_toolchain``) can load them by file path
(the allocator then by path too: ``_toolchain.outputs_module``); the public modules register the kernels into their
operators.
"""
