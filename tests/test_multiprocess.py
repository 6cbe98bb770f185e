"""Several processes (multi-host) equal one: 2 processes x 4 CPU devices.

Two `jax.distributed` processes on localhost, each with 4 CPU devices and
half of every batch, run DP-SGD under `jax.shard_map` over the 8 devices;
the updates must equal those of one process with 8 devices and the whole
batch, with the same key. Processes that draw their own fresh keys must be
refused (one noise draw for all devices needs ONE key).
"""

import json
import os
import pathlib
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import dpsco_jax

REPO = pathlib.Path(__file__).resolve().parent.parent
KEY, BATCH, STEPS = 11, 16, 3
PARAMS = jnp.zeros(3)


def transformation(key, axis_name):
  loss = lambda w, ex: jnp.sum((ex['x'] @ w - ex['y']) ** 2)
  return dpsco_jax.dpsgd(loss, l2_clip=1.0, noise_multiplier=1.0,
                         num_steps=STEPS, key=key, axis_name=axis_name)


def step(tx):
  def run(params, state, batch):
    updates, state = tx.update(None, state, params, batch=batch)
    return optax.apply_updates(params, updates), state, updates
  return run


def batches():
  rng = np.random.default_rng(0)
  for _ in range(STEPS):
    yield {'x': rng.normal(size=(BATCH, 3)).astype(np.float32),
           'y': rng.normal(size=BATCH).astype(np.float32)}


def _free_port():
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return str(s.getsockname()[1])


def _run_two_processes(tmp_path, *extra):
  env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS='cpu')
  env.pop('XLA_FLAGS', None)
  port = _free_port()
  outs = [tmp_path / f'process{i}.json' for i in range(2)]
  procs = [subprocess.Popen(
      [sys.executable, '-m', 'tests.multiprocess_worker', str(i), port,
       str(outs[i]), *extra], cwd=REPO, env=env, stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True) for i in range(2)]
  logs = [p.communicate(timeout=300)[0] for p in procs]
  for p, log in zip(procs, logs):
    assert p.returncode == 0, log
  return [json.loads(out.read_text()) for out in outs]


def _one_process_eight_devices():
  from jax.sharding import Mesh, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  mesh = Mesh(np.array(jax.devices()[:8]), ('devices',))
  tx = transformation(KEY, 'devices')
  run = jax.jit(jax.shard_map(step(tx), mesh=mesh,
                              in_specs=(P(), P(), P('devices')),
                              out_specs=(P(), P(), P()), check_vma=False))
  params, state, result = PARAMS, tx.init(PARAMS), []
  for batch in batches():
    params, state, updates = run(params, state, batch)
    result.append(np.asarray(updates))
  return np.stack(result)


def test_two_processes_equal_one(tmp_path):
  outcomes = _run_two_processes(tmp_path)
  for outcome in outcomes:
    assert 'updates' in outcome, outcome
  first, second = (np.asarray(o['updates']) for o in outcomes)
  np.testing.assert_array_equal(first, second)
  np.testing.assert_allclose(first, _one_process_eight_devices(),
                             rtol=1e-5, atol=1e-6)


def test_a_fresh_key_per_process_is_refused(tmp_path):
  outcomes = _run_two_processes(tmp_path, 'fresh_keys')
  for outcome in outcomes:
    assert 'error' in outcome, outcome
    assert 'the noise key differs across devices' in outcome['error'], outcome
