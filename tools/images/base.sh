#!/usr/bin/env bash
# The local base image for test builds: Debian (minbase variant of debootstrap) with python3 and
# pip, packed as an OCI image with umoci and copied into the containers-storage that buildah and
# podman build from, as localhost/bij-base:<suite>. Published images keep their own bases
# (Dockerfile ARGs); this one only lets `make images` build without a registry.
#
# The machine's CA bundle is copied in: where the package index is reached through an
# intercepting proxy, pip in the image must trust the same roots as the machine.
#
# Usage: tools/images/base.sh OUT_DIR IMAGE_NAME
set -euo pipefail
out="$1"
name="$2"
suite="${BIJ_BASE_SUITE:-bookworm}"
# The machine's own Debian mirror, as apt is configured here (deb822 sources first, then the
# one-line format); BIJ_DEBIAN_MIRROR overrides it.
mirror="${BIJ_DEBIAN_MIRROR:-}"
if [[ -z "$mirror" ]]; then
  mirror="$(sed -n 's/^URIs:[[:space:]]*\([^[:space:]]*debian\/*\)$/\1/p' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -1)"
fi
if [[ -z "$mirror" ]]; then
  mirror="$(awk '$1 == "deb" && $2 ~ /debian\/?$/ {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)"
fi
[[ -n "$mirror" ]] || { echo "images: no Debian mirror in /etc/apt/sources*; set BIJ_DEBIAN_MIRROR" >&2; exit 2; }
ca=/etc/ssl/certs/ca-certificates.crt
[[ -f "$ca" ]] || { echo "images: $ca is missing (apt-get install ca-certificates)" >&2; exit 2; }

# The recipe's hash is a label of the image: buildah's storage is the cache, so a fresh clone on
# the same machine reuses the base (and every layer built on it).
want="$(printf '%s\n' "$(cat "$0" "$ca")" "$suite" "$mirror" | sha256sum | cut -d' ' -f1)"
have="$(skopeo inspect --format '{{index .Labels "dev.bij.base-recipe"}}' "containers-storage:$name" 2>/dev/null || true)"
if [[ "$have" == "$want" ]]; then
  exit 0
fi
echo "images: building the base image $name (debootstrap $suite from $mirror)" >&2
start=$SECONDS
rootfs="$out/base-rootfs"
layout="$out/base-oci"
rm -rf "$rootfs" "$layout" "$out/base-bundle"
mkdir -p "$out"
debootstrap --variant=minbase --include=python3,python3-pip,ca-certificates "$suite" "$rootfs" "$mirror" >&2
cp "$ca" "$rootfs/etc/ssl/certs/ca-certificates.crt"
# What a container image leaves out: package lists and caches, logs of the bootstrap.
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/log/* \
  "$rootfs"/var/cache/debconf/*-old "$rootfs"/tmp/*
umoci init --layout "$layout"
umoci new --image "$layout:$suite"
umoci unpack --image "$layout:$suite" "$out/base-bundle" >/dev/null
cp -a "$rootfs/." "$out/base-bundle/rootfs/"
umoci repack --image "$layout:$suite" "$out/base-bundle"
umoci config --image "$layout:$suite" \
  --config.env "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
  --config.env "LANG=C.UTF-8" --config.cmd python3 --config.label "dev.bij.base-recipe=$want" \
  --author "bij tools/images/base.sh" --history.created_by "debootstrap --variant=minbase $suite"
skopeo copy --quiet "oci:$layout:$suite" "containers-storage:$name" >&2
rm -rf "$rootfs" "$out/base-bundle" "$layout"
echo "images: base image $name built in $((SECONDS - start)) s" >&2
