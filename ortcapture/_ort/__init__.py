"""The ONNX Runtime adaptation layer: what the installed ORT can do, providers, OrtValue facts, cuda-python, shape specialisation, the process-wide gate."""
