"""Checkpoints converted and written: HF safetensors <-> megatron-core dist checkpoints (convert.py), their layouts and shards, staged output, the LoRA export."""
