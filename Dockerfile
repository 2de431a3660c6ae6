# One image for every voxpipe process; docker-compose.yml picks each service's command.
#   docker build -t voxpipe .
#   docker run --gpus all -p 8000:8000 -v voxpipe-cache:/cache voxpipe        # all on one host
# No model weights inside: they download on first start into the /cache volume (Hugging Face
# cache, plus FlashInfer's and torch.compile's compiled kernels), so a rebuild or a new container does not fetch them again.
# FlashInfer's build checks its kernels against the installed headers' times: after a rebuild of
# the image (headers newer than the kernels in /cache) the first start compiles them again, about
# 3-4 minutes for Orpheus on an H200 host; a new container of the same image reuses them.
ARG CUDA_IMAGE=nvidia/cuda:13.0.0-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

# torch's CUDA build must match the image's CUDA major version (CUDA_PKG, TORCH_INDEX).
ARG CUDA_PKG=13-0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu130
ARG TORCH_VERSION=2.13.0
# The FlashInfer the H200 benches ran (bench/results); the `gpu` extra allows newer.
ARG FLASHINFER_VERSION=0.6.18.post1

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# A runtime image has no compiler, but FlashInfer compiles its attention kernels on first use
# (JIT, then cached in /cache): add nvcc and the CUDA headers it needs, not the whole devel image.
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev g++ \
        cuda-nvcc-${CUDA_PKG} cuda-cudart-dev-${CUDA_PKG} cuda-cccl-${CUDA_PKG} \
    && rm -rf /var/lib/apt/lists/*

RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    CUDA_HOME=/usr/local/cuda

# The heavy dependencies first, in their own layer, so a source change does not reinstall them.
RUN pip install --extra-index-url ${TORCH_INDEX} "torch==${TORCH_VERSION}" \
    && pip install "flashinfer-python==${FLASHINFER_VERSION}" ninja

WORKDIR /app
COPY . .
RUN pip install --extra-index-url ${TORCH_INDEX} ".[gpu]" "torch==${TORCH_VERSION}" \
    "flashinfer-python==${FLASHINFER_VERSION}"

RUN useradd --create-home --uid 1000 voxpipe && mkdir -p /cache && chown voxpipe /cache
USER voxpipe
# torch.compile's kernels (the codec's, --codec-compile) are cached there too: a restart reuses them.
ENV XDG_CACHE_HOME=/cache \
    HF_HOME=/cache/huggingface \
    FLASHINFER_WORKSPACE_BASE=/cache \
    TORCHINDUCTOR_CACHE_DIR=/cache/torchinductor \
    TRITON_CACHE_DIR=/cache/triton
VOLUME ["/cache"]

# HTTP; then requests, gateway_in, gpu_in, codec_in; then every process's tap (VOXPIPE_TAP).
EXPOSE 8000 5557 5558 5559 5560 5570
CMD ["voxpipe", "serve", "--host", "0.0.0.0"]
