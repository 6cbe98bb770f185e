"""One process of tests/test_multiprocess.py: 4 CPU devices of an 8-device run.

    python -m tests.multiprocess_worker PROCESS_ID PORT OUT [fresh_keys]

Joins a 2-process `jax.distributed` run on localhost, runs three DP-SGD
steps under `jax.shard_map` over all 8 devices (the batch sharded across
both processes, each feeding its own half), and writes the updates as JSON
to OUT. With `fresh_keys`, each process builds the transformation with
`key=None` (a different fresh key per process): the step must refuse.
"""

import json
import os
import sys

os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=4'

import jax  # pylint: disable=g-import-not-at-top


def main(process_id: int, port: str, out: str, fresh_keys: bool) -> None:
  jax.distributed.initialize(coordinator_address=f'localhost:{port}',
                             num_processes=2, process_id=process_id)
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from dpsco_jax import guards  # pylint: disable=g-import-not-at-top
  from tests import test_multiprocess as common  # pylint: disable=g-import-not-at-top

  mesh = Mesh(np.array(jax.devices()), ('devices',))
  tx = common.transformation(None if fresh_keys else common.KEY, "devices")
  step = jax.jit(jax.shard_map(
      common.step(tx), mesh=mesh, in_specs=(P(), P(), P('devices')),
      out_specs=(P(), P(), P()), check_vma=False))
  sharding = NamedSharding(mesh, P('devices'))
  half = slice(process_id * common.BATCH // 2,
               (process_id + 1) * common.BATCH // 2)
  params, state, result = common.PARAMS, tx.init(common.PARAMS), []
  try:
    for batch in common.batches():
      local = {k: v[half] for k, v in batch.items()}
      global_batch = {k: jax.make_array_from_process_local_data(
          sharding, v, batch[k].shape) for k, v in local.items()}
      params, state, updates = step(params, state, global_batch)
      guards.raise_if_refused(state)
      result.append(np.asarray(multihost_utils.process_allgather(
          updates, tiled=True)).tolist())
    outcome = {'updates': result}
  except Exception as error:  # pylint: disable=broad-except
    outcome = {'error': f'{type(error).__name__}: {error}'}
    # Both processes read the same record and refuse at the same step; meet
    # before exiting, so that neither leaves while the other still reads
    # the step's last collective.
    try:
      multihost_utils.sync_global_devices('refused')
    except Exception:  # pylint: disable=broad-except
      pass
  with open(out, 'w') as f:
    json.dump(outcome, f)
  # Skip the coordinator's shutdown barrier: a refused step leaves the
  # other process in its own error path.
  os._exit(0)  # pylint: disable=protected-access


if __name__ == '__main__':
  main(int(sys.argv[1]), sys.argv[2], sys.argv[3],
       len(sys.argv) > 4 and sys.argv[4] == 'fresh_keys')
