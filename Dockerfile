# Serve a t5compress model repository with NVIDIA's Triton Inference Server.
#
#   t5compress triton runs/export runs/triton --name t5             # or --kind gpu, or --portable
#   docker build -t t5-triton --build-arg REPO=runs/triton .
#   docker run --rm -p 8000:8000 -p 8001:8001 -p 8002:8002 t5-triton         # add --gpus all for --kind gpu
#   docker run --rm -p 8000:8000 -v $PWD/runs/other:/models t5-triton        # or serve a mounted repository
#
# 24.12 (Triton 2.53) is the first release on Ubuntu 24.04 with Python 3.12, for which onnxruntime 1.32 has wheels
# (onnxruntime >= 1.24 has none for the Python 3.10 of older images). Its ONNX Runtime backend serves the leaf
# models of a plain repository; the python backend runs the text model (and the leaf models of a --portable one).
ARG TRITON_IMAGE=nvcr.io/nvidia/tritonserver:24.12-py3
FROM ${TRITON_IMAGE}

# What the server-side python models import: numpy<2, onnxruntime (for --portable leaf models) and tokenizers.
# The image's Python is the system one (PEP 668): install beside it, as NVIDIA's own examples do.
COPY triton_models/requirements.txt /opt/t5compress/requirements.txt
RUN python3 -m pip install --no-cache-dir --break-system-packages -r /opt/t5compress/requirements.txt

# The repository holds the python models and a copy of t5compress.runtime: nothing else to install.
ARG REPO=runs/triton
COPY ${REPO} /models

EXPOSE 8000 8001 8002
CMD ["tritonserver", "--model-repository=/models"]
