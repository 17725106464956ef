"""Answers of the device probe (stages/device.py) for tests that need a known host, whatever host
runs them."""

# What the probe prints on a host with no accelerator (and no torch_npu).
NO_ACCELERATOR = {
    "npu": {"status": "absent", "detail": "torch_npu is not installed"},
    "gpu": {"status": "no-devices", "detail": "CUDA build, but no driver or no visible GPU"},
}
