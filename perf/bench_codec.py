"""Erasure-code throughput: hpcckpt's CPU codec against zfec and reedsolo (and the GPU kernel
when CuPy and a GPU are present). GB/s of *data* bytes (k x block size) per second, median
of several runs, single-threaded.

    python perf/bench_codec.py                 # 64 MiB blocks, (k, m) = (2, 2) and (4, 2)
    python perf/bench_codec.py --quick         # small blocks, < 1 minute on 2 cores
    python perf/bench_codec.py --json out.json --codes 2,2 4,2 6,2

Keys of the JSON: "<codec>_<op>_k<k>m<m>", codec in hpcckpt_cpu, hpcckpt_gpu, zfec, reedsolo;
op in
  encode             parity of k blocks, output arrays allocated by the call (as zfec does)
  encode-prealloc    the same into preallocated buffers (hpcckpt out=; steady state)
  decode             k data blocks back when m data blocks are lost (the worst case)
  decode-1lost       the same with one data block lost (P_0 available: a plain XOR)
Encoding is checked against the CPU codec's bytes (GPU) or decoded back (zfec, reedsolo)
before it is timed. reedsolo is pure Python (~MB/s) and runs on small blocks only.
"""

from __future__ import annotations

from harness import pin_threads  # perf/ is on sys.path: the scripts run from it

pin_threads()  # single-threaded figures: before NumPy loads

import argparse  # noqa: E402
import statistics  # noqa: E402

import numpy as np  # noqa: E402
from harness import machine, print_machine, write_json  # noqa: E402
from harness import time_median as _median_time  # noqa: E402

from hpcckpt.codec import ErasureCode  # noqa: E402

MiB = 1 << 20


def _gbs(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _data(k: int, n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n, dtype=np.uint8) for _ in range(k)]


def bench_hpcckpt_cpu(k, m, data, repeats, res):
    n = data[0].size
    code = ErasureCode(k, m)
    parity = code.encode(data)
    key = f"k{k}m{m}"
    res[f"hpcckpt_cpu_encode_{key}"] = _gbs(k * n, _median_time(lambda: code.encode(data), repeats))
    out = [np.empty(n, np.uint8) for _ in range(m)]
    res[f"hpcckpt_cpu_encode-prealloc_{key}"] = _gbs(
        k * n, _median_time(lambda: code.encode(data, out=out), repeats))
    blocks = data + parity
    lost = min(m, k)
    avail = {i: b for i, b in enumerate(blocks) if i >= lost}
    got = code.decode(avail, n)
    assert all(np.array_equal(a, b) for a, b in zip(got, data)), "hpcckpt decode mismatch"
    res[f"hpcckpt_cpu_decode_{key}"] = _gbs(k * n, _median_time(lambda: code.decode(avail, n), repeats))
    avail1 = {i: b for i, b in enumerate(blocks) if i != 0}
    res[f"hpcckpt_cpu_decode-1lost_{key}"] = _gbs(
        k * n, _median_time(lambda: code.decode(avail1, n), repeats))
    return parity


def bench_zfec(k, m, data, repeats, res):
    try:
        import zfec
    except ImportError:
        print("zfec not installed: skipped (pip install zfec)")
        return
    n = data[0].size
    key = f"k{k}m{m}"
    enc = zfec.Encoder(k, k + m)
    parity_ids = list(range(k, k + m))
    parity = enc.encode(data, parity_ids)
    res[f"zfec_encode_{key}"] = _gbs(k * n, _median_time(lambda: enc.encode(data, parity_ids), repeats))
    # zfec 1.6 overwrites its input blocks unless every surviving primary block is passed at
    # its own index; put parity blocks in the holes left by the lost ones
    blocks = list(data) + [np.frombuffer(p, dtype=np.uint8) for p in parity]
    dec = zfec.Decoder(k, k + m)

    def layout(lost):
        spare = iter(range(k, k + m))
        ids = [i if i not in lost else next(spare) for i in range(k)]
        return [blocks[i] for i in ids], ids

    for op, lost in (("decode", set(range(min(m, k)))), ("decode-1lost", {0})):
        bl, ids = layout(lost)
        got = dec.decode(bl, ids)
        assert all(bytes(a) == d.tobytes() for a, d in zip(got, data)), "zfec decode mismatch"
        res[f"zfec_{op}_{key}"] = _gbs(k * n, _median_time(lambda: dec.decode(bl, ids), repeats))


def bench_reedsolo(k, m, n, repeats, res):
    """reedsolo as an erasure code: one RS codeword of k data + m check bytes per offset."""
    try:
        import reedsolo
    except ImportError:
        print("reedsolo not installed: skipped")
        return
    key = f"k{k}m{m}"
    data = np.stack(_data(k, n, seed=5))  # (k, n)
    rs = reedsolo.RSCodec(nsym=m, nsize=k + m)
    msg = bytearray(data.T.tobytes())  # codeword i = the k bytes at offset i
    cw = np.frombuffer(bytes(rs.encode(msg)), np.uint8).reshape(n, k + m)
    assert np.array_equal(cw[:, :k], data.T)
    res[f"reedsolo_encode_{key}"] = _gbs(k * n, _median_time(lambda: rs.encode(msg), repeats, 0))
    lost = list(range(min(m, k)))
    damaged = cw.copy()
    damaged[:, lost] = 0
    words = [bytearray(w.tobytes()) for w in damaged]

    def decode():
        return [rs.decode(w, erase_pos=lost)[0] for w in words]

    got = decode()
    assert all(bytes(g) == data[:, i].tobytes() for i, g in enumerate(got)), "reedsolo mismatch"
    res[f"reedsolo_decode_{key}"] = _gbs(k * n, _median_time(decode, repeats, 0))


def bench_gpu(k, m, data, parity, repeats, res):
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no device")
    except Exception as exc:  # noqa: BLE001
        print(f"GPU: skipped ({type(exc).__name__}: no usable CuPy/GPU)")
        return
    from hpcckpt.codec.gpu import gpu_apply, gpu_encode

    n = data[0].size
    key = f"k{k}m{m}"
    d = [cupy.asarray(x) for x in data]
    out = [cupy.empty(n, cupy.uint8) for _ in range(m)]
    got = gpu_encode(d, k, m, out=out)
    for a, b in zip(got, parity):
        assert np.array_equal(cupy.asnumpy(a), b), "GPU parity differs from the CPU bytes"

    def timed(fn):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        fn()
        times = []
        for _ in range(repeats):
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3)
        return statistics.median(times)

    res[f"hpcckpt_gpu_encode_{key}"] = _gbs(k * n, timed(lambda: gpu_encode(d, k, m, out=out)))
    code = ErasureCode(k, m)
    lost = list(range(min(m, k)))
    blocks = d + list(got)
    src, rows = code.decode_matrix([i for i in range(k + m) if i not in lost], lost)
    srcs = [blocks[i] for i in src]
    dout = [cupy.empty(n, cupy.uint8) for _ in lost]
    rebuilt = gpu_apply(rows, srcs, dout)
    for i, a in zip(lost, rebuilt):
        assert np.array_equal(cupy.asnumpy(a), data[i]), "GPU decode mismatch"
    res[f"hpcckpt_gpu_decode_{key}"] = _gbs(k * n, timed(lambda: gpu_apply(rows, srcs, dout)))
    del d, out, blocks, srcs, dout


# "Rebuild one lost node vs read it from L4" is measured by perf/bench_rebuild.py.


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="16 MiB blocks, 5 repeats (< 1 min)")
    ap.add_argument("--json", metavar="FILE", help="write {key: GB/s} here")
    ap.add_argument("--codes", nargs="+", default=["2,2", "4,2"], metavar="K,M",
                    help="(k, m) pairs, default 2,2 4,2")
    ap.add_argument("--block-mib", type=float, help="block size in MiB (default 64; quick 16)")
    ap.add_argument("--repeats", type=int, help="timed runs per median (default 7; quick 5)")
    ap.add_argument("--reedsolo-kib", type=float, help="reedsolo block size (default 16; quick 2)")
    args = ap.parse_args(argv)
    block = int((args.block_mib or (16 if args.quick else 64)) * MiB)
    repeats = args.repeats or (5 if args.quick else 7)
    rs_block = int((args.reedsolo_kib or (2 if args.quick else 16)) * 1024)
    codes = [tuple(int(x) for x in c.split(",")) for c in args.codes]

    host = machine()
    print_machine(host)
    print(f"blocks {block / MiB:g} MiB (reedsolo {rs_block // 1024} KiB), median of {repeats}, "
          f"single-threaded")
    res: dict[str, float] = {}
    for k, m in codes:
        data = _data(k, block)
        parity = bench_hpcckpt_cpu(k, m, data, repeats, res)
        bench_zfec(k, m, data, repeats, res)
        bench_reedsolo(k, m, rs_block, max(1, min(repeats, 3)), res)
        bench_gpu(k, m, data, parity, repeats, res)
        del data, parity

    print(f"\n{'codec':<13} {'op':<16} {'k,m':<6} {'GB/s':>9}")
    for key, v in res.items():
        codec, op, km = key.rsplit("_", 2)
        print(f"{codec:<13} {op:<16} {km[1:].replace('m', ','):<6} {v:>9.4g}")
    print()
    for k, m in codes:
        for op in ("encode", "decode", "decode-1lost"):
            a, b = res.get(f"hpcckpt_cpu_{op}_k{k}m{m}"), res.get(f"zfec_{op}_k{k}m{m}")
            if a and b:
                print(f"hpcckpt_cpu / zfec  {op:<13} k={k} m={m}: {a / b:5.1f}x")
    if args.json:
        write_json(args.json, res, host)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
