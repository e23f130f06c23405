"""dataset_hessian_operator across a Dask cluster: H v over 32 batches (each 64 samples of the
paper's MNIST block, L=49, d=16, d_k=16, d_ff=64, float64) on a LocalCluster of two
single-threaded workers against the same operator in one single-threaded process, in one run.
Target: >= 1.6x. The workers run in this process (threads: the core releases the GIL) or in
processes of their own on loopback; each cluster is closed after its measurement."""

from __future__ import annotations

import timeit

import numpy as np

from ._harness import blockhess_api

BATCHES, SAMPLES = 32, 64


def _seconds(fn, repeat=5):
    fn()
    return min(timeit.repeat(fn, number=1, repeat=repeat))


def _data():
    BlockParams, dataset_hessian_operator = blockhess_api("BlockParams", "dataset_hessian_operator")
    params = BlockParams.random(d=16, d_k=16, d_ff=64, seed=0)
    rng = np.random.default_rng(0)
    batches = [(rng.standard_normal((SAMPLES, 49, 16)), rng.standard_normal((SAMPLES, 49, 16)))
               for _ in range(BATCHES)]
    return params, batches, dataset_hessian_operator


class RatioDaskDatasetHVP:
    timeout = 900

    def setup_cache(self):
        try:
            import distributed
        except ImportError as err:  # pragma: no cover - in the test and dask extras
            raise NotImplementedError("dask[distributed] is not installed") from err
        set_num_threads = blockhess_api("set_num_threads")
        params, batches, dataset_hessian_operator = _data()
        v = np.random.default_rng(1).standard_normal(params.size)
        set_num_threads(1)
        local = dataset_hessian_operator(batches, params)
        one_worker = _seconds(lambda: local @ v)
        result = {"one": one_worker}
        # Workers in this process (threads: the core releases the GIL around each product) and in
        # processes of their own (with a nanny each, which share the cores with them).
        for name, options in (("in_process", {"processes": False}), ("processes", {"processes": True, "host": "127.0.0.1"})):
            with distributed.LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=None, silence_logs=40,
                                          **options) as cluster, distributed.Client(cluster) as client:
                client.run(set_num_threads, 1)
                spread = dataset_hessian_operator(batches, params, client=client)
                result[name] = _seconds(lambda: spread @ v)
        return result

    def track_two_workers_over_one(self, result):
        return result["one"] / result["in_process"]

    def track_two_worker_processes_over_one(self, result):
        return result["one"] / result["processes"]

    track_two_workers_over_one.unit = "ratio"
    track_two_worker_processes_over_one.unit = "ratio"
