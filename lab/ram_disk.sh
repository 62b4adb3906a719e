#!/usr/bin/env bash
# What does a bench give where the disk is not the limit? A loop device over a file in RAM
# (/dev/shm), ext4 on it (O_DIRECT works there: the loop driver takes it), and the given command
# run with `--path MOUNT` appended: a stand-in for a drive faster than the CPU, where per-block
# work decides. What it does not model: a drive's latency or queue; reads and writes cost a
# memory copy in the loop driver, on the same CPUs as the bench.
#
#   sudo lab/ram_disk.sh SIZE COMMAND [ARGS...]
#   e.g. sudo lab/ram_disk.sh 6G .venv-vllm/bin/python -P -m uring_kv bench-vllm --row-size 128K
#
# Needs root, losetup and mkfs.ext4, and SIZE of free memory. Leaves nothing behind (trap).
set -euo pipefail
[ $# -ge 2 ] || { sed -n 2,11p "$0"; exit 2; }
size=$1; shift
work=$(mktemp -d /dev/shm/uring-kv-ram.XXXXXX)
dev=""
cleanup() {
    umount "$work/m" 2>/dev/null || true
    [ -z "$dev" ] || losetup -d "$dev" 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT
truncate -s "$size" "$work/disk.img"
dev=$(losetup -f --show "$work/disk.img")
mkfs.ext4 -q "$dev"
mkdir "$work/m"
mount "$dev" "$work/m"
echo "ram_disk: $size ext4 on $dev (backed by $work/disk.img in RAM), mounted at $work/m" >&2
"$@" --path "$work/m"
