#!/bin/sh
# Install what the SSH test hosts (tests/testhosts.py) need, if missing:
# OpenSSH server and client, and iproute2 (`ip netns`); and Slurm (Debian's
# slurmctld, slurmd, slurm-client, munge) for the Slurm tests.  Idempotent.
# Debian/Ubuntu; run as root (or with sudo available).
set -eu

need=""
command -v sshd >/dev/null 2>&1 || [ -x /usr/sbin/sshd ] || need="$need openssh-server"
command -v ssh >/dev/null 2>&1 && command -v ssh-keygen >/dev/null 2>&1 || need="$need openssh-client"
command -v ip >/dev/null 2>&1 || [ -x /usr/sbin/ip ] || [ -x /sbin/ip ] || need="$need iproute2"
command -v scontrol >/dev/null 2>&1 || need="$need slurm-client"
command -v slurmctld >/dev/null 2>&1 || [ -x /usr/sbin/slurmctld ] || need="$need slurmctld"
command -v slurmd >/dev/null 2>&1 || [ -x /usr/sbin/slurmd ] || need="$need slurmd"
command -v munged >/dev/null 2>&1 || [ -x /usr/sbin/munged ] || need="$need munge"
# `unshare` (per-host hostnames) and `nsenter` (a slurmd inside a test host) come from
# util-linux, which is essential on Debian.  The Slurm tests start their own munged,
# slurmctld and slurmds (tests/slurmcluster.py, config in a temp dir): the packages'
# system services and /etc/slurm, /etc/munge are neither needed nor used.

if [ -z "$need" ]; then
    echo "install-test-deps: openssh, iproute2 and slurm already present"
    exit 0
fi

if [ "$(id -u)" -eq 0 ]; then
    SUDO=""
elif command -v sudo >/dev/null 2>&1; then
    SUDO="sudo"
else
    echo "install-test-deps: need root to install:$need" >&2
    exit 1
fi

echo "install-test-deps: installing:$need"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update
# shellcheck disable=SC2086  # word splitting of $need is intended
$SUDO apt-get install -y --no-install-recommends $need

# The package may start a system sshd on 0.0.0.0:22 (where an init system
# allows it).  The test hosts bind only their own addresses, but a wildcard
# listener would shadow the loopback fallback, so stop it.
if pgrep -x sshd >/dev/null 2>&1 || ss -ltn 2>/dev/null | grep -qE '(0\.0\.0\.0|\*|\[::\]):22 '; then
    if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
        $SUDO systemctl disable --now ssh.service ssh.socket 2>/dev/null || true
    elif command -v service >/dev/null 2>&1; then
        $SUDO service ssh stop 2>/dev/null || true
    fi
fi
mkdir -p /run/sshd 2>/dev/null || $SUDO mkdir -p /run/sshd || true
