#!/usr/bin/env bash
# MuJoCo renders the Meta-World suite headless through EGL (jaxpar/robot/metaworld.py). Install Mesa's EGL (software
# rendering, no GPU needed) from Debian's packages where it is missing; without root, say what to install (the
# Meta-World tests then fail, the rest of jaxpar does not need it).
set -uo pipefail
if /sbin/ldconfig -p 2>/dev/null | grep 'libEGL_mesa\.so' >/dev/null; then
    exit 0
fi
PACKAGES="libegl1 libegl-mesa0 libgl1-mesa-dri libgbm1"
if [ "$(id -u)" -ne 0 ]; then
    echo "ensure_egl: Mesa's EGL is missing, which the Meta-World suite renders with: sudo apt-get install $PACKAGES" >&2
    exit 0
fi
set -e
apt-get update -q >/dev/null
DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $PACKAGES >/dev/null
