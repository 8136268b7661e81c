"""LoRA weights: merging an adapter into base weights (the native kernel, its numerics contract)
and safetensors reading/writing.
"""
