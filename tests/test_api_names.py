"""One name per idea, "did you mean", the clipping path a plan took, and the
errors a plan's data gets, as a user meets them."""

import inspect
import json
import os
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dpsco_jax
from dpsco_jax import batching
from dpsco_jax import clipping
from dpsco_jax import data as data_lib
from dpsco_jax import estimators
from dpsco_jax import keywords
from dpsco_jax import plans
from dpsco_jax import samplers
from dpsco_jax.algorithms import baselines
from dpsco_jax.algorithms import diff2
from dpsco_jax.algorithms import mf
from dpsco_jax.algorithms import nonsmooth
from dpsco_jax.algorithms import phased_erm
from dpsco_jax.algorithms import phased_sgd
from dpsco_jax.algorithms import srg
from dpsco_jax.algorithms import user_level

N, FEATURES = 64, 5


def logistic_loss(params, example):
  logit = example['x'] @ params['w'] + params['b']
  return optax.sigmoid_binary_cross_entropy(logit, example['y'])


def _data(n=N):
  rng = np.random.default_rng(0)
  return {'x': rng.normal(size=(n, FEATURES)).astype(np.float32),
          'y': rng.integers(0, 2, size=n).astype(np.float32)}


PARAMS = {'w': jnp.zeros(FEATURES), 'b': jnp.zeros(())}
COMMON = dict(optimizer=optax.sgd(0.1), num_examples=N, batch_size=16,
              epochs=1, delta=1e-5)


# ------------------------------------------------------ one name per idea


CLIPPING_FUNCTIONS = [clipping.clipped_grad_sum,
                      clipping.clipped_grad_difference_sum,
                      clipping.clipped_user_grad_sum]


@pytest.mark.parametrize('make', CLIPPING_FUNCTIONS,
                         ids=lambda f: f.__name__)
def test_the_clipping_path_is_clipping_method_and_method_still_works(make):
  stat = make(logistic_loss, 1.0, clipping_method='vmap')
  assert stat.clipping_method == 'vmap'
  with pytest.warns(DeprecationWarning, match=r'clipping_method=.*0\.3\.0'):
    old = make(logistic_loss, 1.0, method='vmap')
  assert old.clipping_method == 'vmap'
  with pytest.warns(DeprecationWarning, match='clipping_method'):
    assert old.method == 'vmap'     # the attribute's old name, too
  with pytest.raises(TypeError, match='give clipping_method= only'):
    make(logistic_loss, 1.0, method='vmap', clipping_method='ghost')


def test_a_hand_built_statistic_takes_the_old_keyword_with_a_warning():
  with pytest.warns(DeprecationWarning, match='clipping_method'):
    stat = dpsco_jax.ClippedStatistic(lambda example: example, 1.0,
                                      method='vmap')
  assert stat.clipping_method == 'vmap'


def test_a_clipping_path_given_as_the_accounting_method_names_the_keyword():
  # In a plan, method= is the accounting method ('pld', 'rdp', ...).
  with pytest.raises(ValueError, match="did you mean clipping_method='vmap'"):
    plans.dpsgd(logistic_loss, l2_clip=1.0, noise_multiplier=1.0,
                method='vmap', **COMMON)


@pytest.mark.parametrize('keyword, meant', [
    ('l2_norm_clip', 'l2_clip'),        # optax.contrib.dpsgd, TF Privacy
    ('max_grad_norm', 'l2_clip'),       # Opacus
    ('eps', 'epsilon'),
    ('noise_scale', 'noise_multiplier'),
    ('noise_multipler', 'noise_multiplier'),   # a typo
    ('accounting_method', 'method'),
])
def test_foreign_and_misspelled_keywords_get_did_you_mean(keyword, meant):
  given = {'l2_clip': 1.0, 'noise_multiplier': 1.0, **COMMON}
  given.pop(meant, None)
  given[keyword] = 'rdp' if meant == 'method' else 1.0
  with pytest.raises(TypeError, match=f'did you mean {meant}='):
    plans.dpsgd(logistic_loss, **given)
  with pytest.raises(TypeError, match=f"'{keyword}'"):
    plans.dpsgd(logistic_loss, **given)


def test_an_unknown_keyword_without_a_near_name_lists_the_keywords():
  with pytest.raises(TypeError, match=r'takes: .*l2_clip=.*noise_multiplier='):
    dpsco_jax.dpsgd(logistic_loss, l2_clip=1.0, noise_multiplier=1.0,
                    num_steps=10, verbose=True)


def test_a_builder_is_named_where_users_reach_it():
  # phased_sgd is defined in algorithms/phased_sgd.py; users reach it as
  # user_level.phased_sgd, and the message names it so.
  with pytest.raises(TypeError,
                     match=r'^user_level\.phased_sgd\(\) got an unexpected'):
    user_level.phased_sgd(None, None, None, num_group=10)


def _builders():
  """Every public builder (or preset) of the plans, algorithms, estimators
  and clipping modules: a public function taking a clip, a noise or a
  privacy target keyword (argument validators aside)."""
  modules = [plans, baselines, diff2, mf, nonsmooth, srg, user_level,
             phased_sgd, phased_erm, estimators, clipping]
  marks = {'l2_clip', 'grad_clip', 'noise_multiplier', 'noise_multipliers',
           'epsilon', 'clipping_method', 'clips'}
  found = {}
  for module in modules:
    for name, fn in vars(module).items():
      if (name.startswith(('_', 'validate_')) or
          not isinstance(fn, types.FunctionType) or
          fn.__module__ != module.__name__):
        continue
      if marks & set(inspect.signature(fn).parameters):
        found[f'{module.__name__}.{name}'] = fn
  return found


BUILDERS = _builders()


def test_every_public_builder_checks_its_keywords():
  assert len(BUILDERS) >= 30, sorted(BUILDERS)
  unchecked = [name for name, fn in BUILDERS.items()
               if not keywords.is_checked(fn)]
  assert unchecked == []
  assert keywords.is_checked(clipping.ClippedStatistic)
  # Each answers a foreign keyword before doing any work.
  for name, fn in BUILDERS.items():
    parameters = set(inspect.signature(fn).parameters)
    for keyword, (targets, _) in keywords.FOREIGN.items():
      meant = next((t for t in targets if t in parameters), None)
      if meant is None or keyword in parameters:
        continue
      with pytest.raises(TypeError, match=f'did you mean {meant}='):
        fn(**{keyword: 1.0})


# -------------------------------------------- the clipping path actually run


def _tanh_layer_loss(params, example):
  return jnp.sum(jnp.tanh(example['x'] @ params['w']))


def _one_step(plan, params, data):
  state = plan.init(params)
  inputs = next(plan.batches_of(data))
  return plan.step(params, state, inputs)


# A dense layer on one vector per example: the ghost path. The same layer
# over 512 positions of width 16 forms its per-example gradient anyway, so
# 'auto' takes the vmap path by its cost estimate, though the ghost path
# applies (`ghost_plan(...) is not None`: what the README's check said).
PATH_CASES = {'ghost': (None, 64), 'vmap': (512, 16)}


@pytest.mark.parametrize('expected', list(PATH_CASES))
def test_describe_records_the_clipping_path_the_step_took(expected):
  positions, width = PATH_CASES[expected]
  rng = np.random.default_rng(0)
  n = 8
  shape = (n, width) if positions is None else (n, positions, width)
  data = {'x': rng.normal(size=shape).astype(np.float32)}
  params = {'w': jnp.asarray(rng.normal(size=(width, width)) / width**0.5,
                             jnp.float32)}
  plan = plans.dpsgd(_tanh_layer_loss, optimizer=optax.sgd(0.1),
                     num_examples=n, batch_size=4, epochs=1, l2_clip=1.0,
                     noise_multiplier=1.0, delta=1e-5, sampling='fixed')
  assert plan.describe()['clipping_path'] == 'not traced yet'
  _one_step(plan, params, data)
  description = plan.describe()
  assert description['clipping_path'] == expected
  json.dumps(description)
  # The ghost path applies in both cases: that check could not tell them
  # apart.
  stat = clipping.clipped_grad_sum(_tanh_layer_loss, 1.0)
  batch = jax.tree.map(lambda a: a[:4], data)
  assert stat.ghost_plan(batch, params) is not None
  stat(batch, params)
  assert stat.clipping_path == expected


def test_a_plan_told_to_use_vmap_says_so():
  plan = plans.dpsgd(logistic_loss, l2_clip=1.0, noise_multiplier=1.0,
                     clipping_method='vmap', **COMMON)
  _one_step(plan, PARAMS, _data())
  assert plan.describe()['clipping_path'] == 'vmap'


# --------------------------------------------- errors that name the fix


@pytest.fixture(scope='module')
def machines():
  return data_lib.load_table(
      os.path.join(os.path.dirname(__file__), 'data', 'machines.csv'),
      task='classification', target='failure',
      features=['air_temp_k', 'process_temp_k', 'rotation_rpm', 'torque_nm',
                'tool_wear_min'],
      scaling='public', lower=[290, 300, 1000, 0, 0],
      upper=[310, 320, 2000, 80, 250])


def test_the_loaders_table_instead_of_table_train_is_named(machines):
  plan = plans.dpsgd(logistic_loss, optimizer=optax.sgd(0.1),
                     num_examples=machines.num_examples, batch_size=60,
                     epochs=1, l2_clip=1.0, noise_multiplier=1.0, delta=1e-6)
  with pytest.raises(TypeError, match=r'pass table\.train'):
    for _ in plan.batches_of(machines):
      pass
  assert next(plan.batches_of(machines.train))['batch']['x'].shape[1] == 5


def test_string_labels_given_to_a_plan_name_the_encoding():
  data = _data()
  labels = np.where(data['y'] == 1, 'fail', 'ok')     # read from a CSV
  plan = plans.dpsgd(logistic_loss, l2_clip=1.0, noise_multiplier=1.0,
                     **COMMON)
  with pytest.raises(TypeError,
                     match=r"data\['y'\] holds .*np\.unique.*load_table"):
    for _ in plan.batches_of({'x': data['x'], 'y': labels}):
      pass


def test_mismatched_rows_say_which_array():
  data = _data()
  plan = plans.dpsgd(logistic_loss, l2_clip=1.0, noise_multiplier=1.0,
                     **COMMON)
  with pytest.raises(ValueError, match=r"32 \(data\['x'\]\), 64 "
                                       r"\(data\['y'\]\).*num_examples = 64"):
    next(plan.batches_of({'x': data['x'][:32], 'y': data['y']}))


# ----------------------------------------------------------- small ones


def test_a_remainder_is_announced_once_for_several_plans(monkeypatch):
  # The quick start's three fixed-order runs share n = 1437 and B = 239.
  monkeypatch.setattr(samplers, '_REMAINDERS_ANNOUNCED', set())
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    for _ in range(2):
      plans.dpftrl(logistic_loss, optimizer=optax.sgd(0.1),
                   num_examples=1437, batch_size=239, epochs=2, l2_clip=1.0,
                   noise_multiplier=1.0, delta=1e-5)
    batching.FixedOrderBatches(1437, 239, 2)
    batching.FixedOrderBatches(1437, 200, 2)   # another remainder
  remainders = [str(w.message) for w in caught
                if issubclass(w.category, batching.RemainderWarning)]
  assert len(remainders) == 2, remainders
  assert '3 example(s)' in remainders[0] and '37 example(s)' in remainders[1]


def test_every_family_knows_its_statistics_before_the_first_step():
  # Built, not run: the path is known once the step is traced, and a plan
  # that recorded no statistic would say None instead. method='rdp': the
  # accountant plays no part here, and PLD's epsilons would cost more than
  # the rest of the test.
  sgd, rdp = optax.sgd(0.1), dict(method='rdp')
  built = {
      'user_level_dpsgd': plans.user_level_dpsgd(
          logistic_loss, optimizer=sgd, num_users=N, users_per_batch=16,
          epochs=1, l2_clip=1.0, noise_multiplier=1.0, delta=1e-5, **rdp),
      'dp_srg_memf': plans.dp_srg_memf(
          logistic_loss, l2_clip=1.0, decay=0.5, noise_multiplier=1.0,
          strategy='banded_sqrt', bands=2, **COMMON, **rdp),
      'diff2_gd': plans.diff2_gd(
          logistic_loss, learning_rate=0.1, num_rounds=4, restart_interval=2,
          grad_clip=1.0, diff_clip_factor=1.0, num_examples=N, delta=1e-5,
          noise_multipliers=(1.0, 1.0), **rdp),
      'dp_gd': plans.dp_gd(
          logistic_loss, learning_rate=0.1, num_rounds=4, grad_clip=1.0,
          num_examples=N, delta=1e-5, noise_multiplier=1.0, **rdp),
      'nonsmooth_multi_pass': plans.nonsmooth_multi_pass(
          logistic_loss, order='first', num_examples=N, num_steps=4,
          dimension=FEATURES + 1, lipschitz=1.0, smoothing_radius=0.1,
          movement_radius=0.01, learning_rate=0.1, block_length=2, period=2,
          num_directions=2, delta=1e-5, noise_multipliers=(1.0, 1.0),
          **rdp),
  }
  for name, plan in built.items():
    assert plan.describe()['clipping_path'] == 'not traced yet', name
