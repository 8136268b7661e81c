#!/bin/bash
# Make a local stand-in for python:X.Y-slim-bookworm where no container registry can be reached
# (`make images`, docs/production.md "Building the images here").
#
#   docker/local-base.sh PYTHON IMAGE      e.g. docker/local-base.sh ~/.pyenv/versions/3.12.1/bin/python3.12 localhost/loraflow-base:3.12
#
# A Debian bookworm root file system from Debian's packages (mmdebstrap, minbase, through this machine's
# apt sources), the shared libraries CPython's modules link (the same set as the official slim image),
# and PYTHON's installation (its standard library and pip; no other site-packages, tests or static library) copied
# under /usr/local, where the official image has its interpreter. The CA certificates this machine
# trusts go in too, so that pip and uv reach the package registries from inside a build as they do here.
# Run as root (mmdebstrap and buildah mount). Nothing of this script is in an image built elsewhere:
# there the Dockerfiles' default base, the public python image, is pulled.
set -euo pipefail

python=$1
image=$2
[[ -x $python ]] || { echo "local-base.sh: $python is not an executable Python; give an interpreter such as ~/.pyenv/versions/3.12.1/bin/python3.12" >&2; exit 2; }
prefix=$("$python" -c 'import sys; print(sys.base_prefix)')
version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')

container=$(buildah from scratch)
trap 'buildah rm "$container" >/dev/null' EXIT
root=$(buildah mount "$container")

# The runtime libraries of CPython's extension modules (_ssl, _ctypes, _sqlite3, _lzma, _bz2, readline,
# curses, dbm, uuid) and the CA store: what python:X.Y-slim-bookworm installs.
mmdebstrap --quiet --variant=minbase \
    --include=ca-certificates,netbase,tzdata,libssl3,libffi8,libsqlite3-0,zlib1g,libbz2-1.0,liblzma5,libreadline8,libncursesw6,libgdbm6,libuuid1,libexpat1 \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
    bookworm "$root" /etc/apt/sources.list.d/debian.sources

tar -C "$prefix" -c \
    --exclude="lib/python$version/site-packages/*" --exclude="lib/python$version/test" \
    --exclude="lib/python$version/idlelib" --exclude="lib/python$version/tkinter" --exclude='__pycache__' --exclude='*.a' \
    bin include lib share | tar -C "$root/usr/local" -x
tar -C "$prefix/lib/python$version/site-packages" -c pip | tar -C "$root/usr/local/lib/python$version/site-packages" -x
# Its scripts (pip, pydoc, ...) name the interpreter by the path it was installed at: point them at /usr/local.
grep -lrs "^#!$prefix/bin/" "$root/usr/local/bin" | xargs -r sed -i "1s|^#!$prefix/bin/|#!/usr/local/bin/|"
# The interpreter's RUNPATH names where it was built; the loader falls back to /usr/local/lib, which ldconfig indexes.
chroot "$root" ldconfig

if compgen -G '/usr/local/share/ca-certificates/*.crt' >/dev/null; then
    cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/"
    chroot "$root" update-ca-certificates >/dev/null
fi

buildah umount "$container" >/dev/null
buildah config --env PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin --env LANG=C.UTF-8 \
    --env SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt --env PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    --cmd "python$version" --label "org.loraflow.local-base=$("$python" -V 2>&1) on Debian bookworm" "$container"
buildah commit --quiet --rm "$container" "$image" >/dev/null
trap - EXIT
check=$(buildah from "$image")
trap 'buildah rm "$check" >/dev/null' EXIT
buildah run --isolation chroot "$check" python -c 'import ssl, ctypes, sqlite3, lzma, bz2, zlib, uuid, sys; print(sys.version.split()[0], sys.prefix)'
echo "$image: $(buildah images --format '{{.Size}}' "$image")"
