"""One process driving two ranks through raw peer pointers (set_peer_pointers), the path JAX
takes when one process drives several GPUs: with two GPUs on devices 0 and 1 (NVLink), with
one both on device 0, their kernels on two streams at once (sizes kept small so both grids are
resident together: a spin-wait needs its peer running).
"""

import numpy as np

from tests.gpu.workers.common import keep_max, plain_ulps


def run(*, tokens, hidden, seed):
    import torch
    from jax_fusedar.common import native

    ext = native.require()
    world = 2
    devices = [r % torch.cuda.device_count() for r in range(world)]
    code = native.DTYPE_CODES["bfloat16"]
    ranks = [ext.Rank(devices[r], world, r, max(tokens), hidden, code) for r in range(world)]
    for r, rank in enumerate(ranks):
        for p, peer in enumerate(ranks):
            if p != r:
                rank.set_peer_pointers(p, devices[p], peer.local_pointers())
    for rank in ranks:
        rank.finalize()
    streams = [torch.cuda.Stream(device=d) for d in devices]
    worst = {"residual": 0.0, "norm": 0.0, "cases": 0}
    rng = np.random.default_rng(seed)
    for m in tokens:
        normal = lambda: torch.from_numpy(rng.standard_normal((m, hidden), dtype=np.float32))
        xs = [normal().bfloat16() for _ in range(world)]
        res = normal().bfloat16()
        gam = torch.from_numpy(rng.uniform(-2, 2, hidden).astype(np.float32)).bfloat16()
        outs = []
        for r in range(world):
            with torch.cuda.device(devices[r]):
                x, rd, gd = xs[r].cuda(), res.cuda(), gam.cuda()
                ro, no = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
                torch.cuda.synchronize()
                outs.append((x, rd, gd, ro, no))
        for r in range(world):  # launched back to back, before either is waited for
            x, rd, gd, ro, no = (t.data_ptr() for t in outs[r])
            kw = dict(residual_in=rd, residual_out=ro, norm_out=no, rms_gamma=gd, algorithm=1)
            ranks[r].launch(1, code, m, hidden, x, **kw, stream=streams[r].cuda_stream)
        for s in streams:
            s.synchronize()
        x32, r32, g32 = [t.float().numpy() for t in xs], res.float().numpy(), gam.float().numpy()
        for r in range(world):
            ro, no = outs[r][3].float().cpu().numpy(), outs[r][4].float().cpu().numpy()
            keep_max(worst, plain_ulps(x32, r32, g32, "bfloat16", residual_out=ro, norm_out=no))
        worst["cases"] += 1
    for rank in ranks:
        rank.destroy()
    return {"devices": devices, "worst": worst}


if __name__ == "__main__":
    import json
    import os
    import sys

    hidden = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    seed = int.from_bytes(os.urandom(4), "little")
    print(json.dumps(run(tokens=(1, 16, 64), hidden=hidden, seed=seed)))
