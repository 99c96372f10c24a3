#!/usr/bin/env bash
# `make images`: the operator image and a CPU worker image, built from the project's Dockerfile
# with buildah on a Debian base made here (base.sh), into the local containers-storage:
#   localhost/bij-operator:dev       Dockerfile --target operator
#   localhost/bij-worker:cpu         Dockerfile --target worker, [cpu] extras and PyPI's torch
# No registry is needed. The GPU worker (the pinned vLLM base) is built the same way where that
# base can be pulled: buildah bud --target worker -t bij-worker:dev .
# Timings go to $BIJ_IMAGES_DIR/times.log. Exit 3 says which tool is missing.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
out="${BIJ_IMAGES_DIR:-$root/.images}"
base="${BIJ_BASE_IMAGE:-localhost/bij-base:bookworm}"
operator="${BIJ_OPERATOR_IMAGE:-localhost/bij-operator:dev}"
worker="${BIJ_WORKER_IMAGE:-localhost/bij-worker:cpu}"
torch="${TORCH:-torch==2.13.0}"

missing=()
for tool in buildah skopeo umoci debootstrap; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
if ((${#missing[@]})); then
  echo "make images: missing ${missing[*]}: on Debian or Ubuntu, apt-get install buildah skopeo umoci debootstrap" >&2
  exit 3
fi
if [[ "$(id -u)" != 0 ]]; then
  echo "make images: run as root (debootstrap and buildah's storage here need it)" >&2
  exit 3
fi
mkdir -p "$out"
log() { echo "$(date -u +%FT%TZ) $*" | tee -a "$out/times.log" >&2; }

start=$SECONDS
bash "$root/tools/images/base.sh" "$out" "$base"
log "base $base ready in $((SECONDS - start)) s"

# --network host: the build steps reach the package index as this machine does. The ulimits: a
# container's default nofile limit is above what an unprivileged root (no CAP_SYS_RESOURCE) may
# raise to; 1024 is what the build steps need.
bud=(buildah bud --layers --pull=false --network host --ulimit nofile=1024:1024 --ulimit nproc=4096:4096
     --build-arg "PYTHON_IMAGE=$base" --file "$root/Dockerfile")

step=$SECONDS
"${bud[@]}" --target operator --tag "$operator" "$root" >&2
log "operator $operator built in $((SECONDS - step)) s"

step=$SECONDS
"${bud[@]}" --target worker --tag "$worker" --build-arg "VLLM_IMAGE=$base" \
  --build-arg "WORKER_EXTRAS=[cpu]" --build-arg "TORCH=$torch" "$root" >&2
log "worker $worker built in $((SECONDS - step)) s"

for image in "$operator" "$worker"; do
  log "$(buildah images --format '{{.Name}}:{{.Tag}} {{.Size}}' "$image")"
done
log "make images: done in $((SECONDS - start)) s"
