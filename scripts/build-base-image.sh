#!/usr/bin/env bash
# Build the local base image `modalmesh-base:bookworm` (Debian 12 minbase) with
# debootstrap + `docker import`, for hosts that reach no container registry.
# Does nothing when the image already exists, so image layers stay cached.
#
#   scripts/build-base-image.sh [IMAGE] [MIRROR]
#
# MIRROR defaults to the first Debian mirror this host's apt uses.
set -euo pipefail
IMAGE="${1:-${MODALMESH_BASE_IMAGE:-modalmesh-base:bookworm}}"
SUITE="${MODALMESH_BASE_SUITE:-bookworm}"

if docker image inspect "$IMAGE" >/dev/null 2>&1; then
    echo "base image $IMAGE present"
    exit 0
fi

host_mirror() {
    local uri=""
    if ls /etc/apt/sources.list.d/*.sources >/dev/null 2>&1; then
        uri=$(awk '/^URIs:/ && $2 !~ /security/ {print $2; exit}' /etc/apt/sources.list.d/*.sources)
    fi
    if [ -z "$uri" ] && [ -f /etc/apt/sources.list ]; then
        uri=$(awk '/^deb / && $0 !~ /security/ {for (i = 2; i <= NF; i++) if ($i ~ /^https?:/) {print $i; exit}}' /etc/apt/sources.list)
    fi
    echo "${uri:-http://deb.debian.org/debian}"
}
MIRROR="${2:-${MODALMESH_DEBIAN_MIRROR:-$(host_mirror)}}"

command -v debootstrap >/dev/null || {
    echo "debootstrap is missing: apt-get install -y debootstrap" >&2
    exit 1
}
ROOTFS=$(mktemp -d /tmp/modalmesh-rootfs.XXXXXX)
trap 'rm -rf "$ROOTFS"' EXIT
echo "debootstrap --variant=minbase $SUITE from $MIRROR"
debootstrap --variant=minbase "$SUITE" "$ROOTFS" "$MIRROR" >/tmp/modalmesh-debootstrap.log 2>&1 || {
    tail -30 /tmp/modalmesh-debootstrap.log >&2
    exit 1
}
# The same sources as a Debian image: the release, its updates and security.
cat >"$ROOTFS/etc/apt/sources.list" <<SOURCES
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb ${MIRROR%/debian}/debian-security $SUITE-security main
SOURCES
# Keep images small: no apt caches, docs or man pages (as the official Debian images do).
cat >"$ROOTFS/etc/apt/apt.conf.d/docker-clean" <<'CONF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache ""; Dir::Cache::srcpkgcache "";
APT::Install-Recommends "false";
CONF
cat >"$ROOTFS/etc/dpkg/dpkg.cfg.d/docker-nodoc" <<'CONF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
CONF
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/*.bin "$ROOTFS"/var/cache/apt/archives/*.deb
tar -C "$ROOTFS" -c . | docker import \
    -c 'ENV LANG=C.UTF-8' -c 'CMD ["/bin/bash"]' \
    -m "debootstrap --variant=minbase $SUITE $MIRROR" - "$IMAGE"
echo "built $IMAGE"
