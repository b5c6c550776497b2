"""MX quantisation (OCP MXFP8 / MXFP4) for the scaled GEMMs: ``formats`` holds the element formats, the E8M0 block
scales and the reference casts (bit-exact with torchao's ``to_mx``). The torchao ``quantize_`` configs and the MX
operators build on it; until they exist ``Fly*Strategy(quantization=...)`` takes torchao's own configs."""
