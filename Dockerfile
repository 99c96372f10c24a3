# syntax=docker/dockerfile:1.7
# Two images from one build:
#   docker build --target worker   -t bij-worker:dev .     # vLLM + bij-worker (GPU pods)
#   docker build --target operator -t bij-operator:dev .   # kopf operator (small, CPU only)
# The chart's values image / workerImage point at these. `make images` builds both with buildah on
# a Debian base made locally (tools/images/), the worker for CPU: any base with python3 and pip will
# do, an "externally managed" distribution Python included.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
# Pinned: the engine is the part of the stack whose behaviour changes between releases.
# Pin by digest too (vllm/vllm-openai:v0.33.0@sha256:...) for reproducible builds.
ARG VLLM_IMAGE=vllm/vllm-openai:v0.33.0

# --- build: one wheel with the bij package ---------------------------
FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
# A distribution's Python (Debian's) is marked externally managed: pip refuses to install into it
# unless told that this image is its only user.
ENV PIP_BREAK_SYSTEM_PACKAGES=1
RUN python3 -m pip install --no-cache-dir setuptools==84.2.1 wheel==0.48.0
COPY pyproject.toml README.md* ./
COPY src/ src/
RUN python3 -m pip wheel --no-cache-dir --no-deps --no-build-isolation -w /wheels .

# --- worker: the round Job pods -------------------------------------------------------------
FROM ${VLLM_IMAGE} AS worker
# vLLM, torch and CUDA come with the base image; [vllm] is then already satisfied and only
# bij's own light dependencies are added. The base image's Python may be marked
# externally managed; this image is that environment's only user.
ENV PIP_BREAK_SYSTEM_PACKAGES=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/home/bij \
    HF_HOME=/models/huggingface
# A CPU worker for tests: --build-arg VLLM_IMAGE=python:3.11-slim-bookworm --build-arg WORKER_EXTRAS=[cpu]
#   --build-arg TORCH=torch==2.13.0 (the engine for [cpu]; its own layer, so that a change to bij's
#   code does not download it again). The vLLM base brings its own torch: TORCH stays empty.
ARG TORCH=
RUN if [ -n "$TORCH" ]; then python3 -m pip install "$TORCH"; fi
ARG WORKER_EXTRAS=[vllm]
# COPY, not RUN --mount=from=build: buildah finds a bind mount's stage only when it built that
# stage in the same run, not when the stage came from its layer cache.
COPY --from=build /wheels /tmp/wheels
RUN python3 -m pip install "$(ls /tmp/wheels/bij-*.whl)${WORKER_EXTRAS}" \
    && rm -rf /tmp/wheels \
    && python3 -c "import bij.cli.worker, bij.worker.main, bij.steps.publish_rows"
# uid 1000, as the round Jobs' securityContext expects (runAsNonRoot needs a numeric USER).
# Some bases already have a uid 1000 user (ubuntu); reuse it, with our own HOME.
RUN (getent passwd 1000 >/dev/null || useradd --uid 1000 --user-group --no-create-home --shell /usr/sbin/nologin bij) \
    && mkdir -p /home/bij /models \
    && chown 1000:1000 /home/bij /models
USER 1000:1000
WORKDIR /home/bij
EXPOSE 9400
ENTRYPOINT ["bij-worker"]

# --- optional: a worker with the weights baked in ----------------------------------------------
# No download at pod start, at the price of a much larger image. Bake outside /models: the model
# cache volume is mounted there and would hide them. Then set spec.model.name: /opt/models/model.
#   docker build --target worker-with-model --build-arg MODEL=Qwen/Qwen2.5-7B-Instruct \
#     --secret id=hf_token,env=HF_TOKEN -t bij-worker:qwen2.5-7b .
# FROM worker AS worker-with-model
# ARG MODEL
# USER root
# RUN --mount=type=secret,id=hf_token,env=HF_TOKEN \
#     huggingface-cli download "$MODEL" --local-dir /opt/models/model \
#     && chown -R 1000:1000 /opt/models
# USER 1000:1000

# --- operator: plans rounds, creates Jobs, publishes ----------------------------------------
FROM ${PYTHON_IMAGE} AS operator
ENV PIP_BREAK_SYSTEM_PACKAGES=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
COPY --from=build /wheels /tmp/wheels
RUN python3 -m pip install "$(ls /tmp/wheels/bij-*.whl)[operator]" \
    && rm -rf /tmp/wheels \
    && python3 -c "import bij.cli.main, kopf"
RUN useradd --uid 1000 --user-group --no-create-home --shell /usr/sbin/nologin bij
# The chart mounts the root filesystem read-only with an emptyDir at /tmp.
USER 1000:1000
WORKDIR /tmp
EXPOSE 8080
ENTRYPOINT ["bij", "operator"]

# --- steps: a bij's storage steps (plan, finish, publish plan, manifest) -------------------------
# The operator image with bij-worker as its entrypoint: bij, pyarrow and boto3, no engine, so a
# one-second step never waits for a GPU image to be pulled. The chart's stepsImage (default: the
# operator image itself, whose pods the step Jobs run with command bij-worker).
FROM operator AS steps
ENTRYPOINT ["bij-worker"]
