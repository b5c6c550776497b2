"""MX quantisation configs for torchao's ``quantize_`` (MXFP8 / MXFP4 scaled GEMMs): not built yet, no issue filed
for them (see the README's layout table). Until then ``Fly*Strategy(quantization=...)`` takes torchao's own configs."""
