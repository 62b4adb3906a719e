#!/usr/bin/env bash
# Does a striped store keep several drives busy at once? Simulated drives where the machine has
# one disk: N loop devices (ext4 each), every one throttled to RATE MB/s of reads and of writes by
# the blkio cgroup, and `uring-kv bench --path` over their mounts, run inside that cgroup. Each
# drive then has its own ceiling (RATE) and the sum is N x RATE, as with N real drives. What it does
# not model: a drive's latency under load or its queue depth, only its bandwidth.
#
#   sudo lab/striping_sim.sh [N=4] [RATE_MB=200] [SIZE=1G] [BLOCK=128K] [extra bench options...]
#
# Needs root, losetup, mkfs.ext4 and cgroup v1's blkio controller at /sys/fs/cgroup/blkio (where
# it is missing the script says so and stops). Leaves nothing behind (trap).
set -euo pipefail
n=${1:-4}; rate=${2:-200}; size=${3:-1G}; block=${4:-128K}; shift $(( $# < 4 ? $# : 4 ))
python=${PYTHON:-$(dirname "$0")/../.venv/bin/python}
cg=/sys/fs/cgroup/blkio
[ -w "$cg" ] || { echo "striping_sim: needs root and cgroup v1 blkio at $cg" >&2; exit 2; }
work=$(mktemp -d /var/tmp/uring-kv-sim.XXXXXX)
group=$cg/uring-kv-sim-$$
devices=()
cleanup() {
    for i in "${!devices[@]}"; do umount "$work/m$i" 2>/dev/null || true; losetup -d "${devices[$i]}" 2>/dev/null || true; done
    rmdir "$group" 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT
mkdir "$group"
bytes=$("$python" -P -c "import sys; from uring_kv.bench.args import byte_size; print(byte_size(sys.argv[1]))" "$size")
paths=()
for i in $(seq 0 $((n - 1))); do
    truncate -s $(( bytes * 3 / n + (2 << 30) )) "$work/d$i.img"  # sparse
    dev=$(losetup -f --show "$work/d$i.img")
    devices+=("$dev")
    mkfs.ext4 -q "$dev"
    mkdir "$work/m$i"
    mount "$dev" "$work/m$i"
    majmin=$(lsblk -dno MAJ:MIN "$dev" | tr -d ' ')
    echo "$majmin $(( rate * 1000000 ))" > "$group/blkio.throttle.read_bps_device"
    echo "$majmin $(( rate * 1000000 ))" > "$group/blkio.throttle.write_bps_device"
    paths+=(--path "$work/m$i")
done
echo "striping_sim: $n loop devices, each throttled to $rate MB/s each way (sum $(( n * rate )) MB/s)" >&2
# the bench runs in the cgroup: its I/O (io_uring's workers are its threads) is throttled per device
bash -c 'echo $$ > "$1/cgroup.procs"; shift; exec "$@"' _ "$group" \
    "$python" -P -m uring_kv bench "${paths[@]}" --size "$size" --block-size "$block" "$@"
