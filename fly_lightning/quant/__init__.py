"""MX quantisation (OCP MXFP8 / MXFP4) for the forward GEMMs: ``formats`` (element formats, E8M0 block scales, the
reference casts, bit-exact with torchao's ``to_mx``), ``config.FlyMXConfig`` for torchao's ``quantize_`` (also
``fly_lightning.FlyMXConfig``), and ``linear.FlyMXLinear``, the module it swaps in.

This package imports nothing itself: ``formats`` sits under the MX operators, ``config`` and ``linear`` above them.
"""
