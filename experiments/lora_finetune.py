"""Private LoRA fine-tuning of a small decoder language model, end to end.

The workflow most users of private training run: a language model trained
WITHOUT privacy on public text, then fine-tuned privately on a private
text of another domain, with low-rank adapters (LoRA) on the frozen base:

1. pretrain `models.Decoder` (character-level, causal mask, learned
   positions) on the public text with Adam, no privacy;
2. fine-tune it on the private training split by a DP-SGD plan
   (`dpsco_jax.plans.dpsgd`: Poisson sampling, noise calibrated to the
   config's (epsilon, delta); the privacy unit is one sequence), training
   only the adapters (`lora`) or every base parameter (`full`), under each
   of the config's clipping methods;
3. the same fine-tuning without privacy, as the reference;
4. the perplexity on a held-out part of the private text before and after.

    python -m experiments.lora_finetune --output_dir=results/lora_finetune

Writes `summary.csv` (one row per fine-tuning run and seed: epsilon,
perplexity before and after), `metrics.csv` (every evaluation),
`perplexity.png` (held-out perplexity over the fine-tuning) and
`run_record.json`. The held-out evaluations read private text: they are
diagnostics outside the privacy guarantee.
"""

import itertools
import math
import os
import time
import warnings
from typing import Any, Callable, Iterator, NamedTuple, Optional

from flax import nnx
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from dpsco_jax import batching
from dpsco_jax import keys
from dpsco_jax import plans
from experiments import cli
from experiments import models
from experiments import outputs
from experiments import quickstart
from experiments import spine
from experiments import text_data

PyTree = Any
CORPORA = ('fortunes', 'generated')
FINETUNE = ('lora', 'full')
CLIPPING_METHODS = ('auto', 'ghost', 'vmap')


class Corpora(NamedTuple):
  """The four splits of a run, each `{'x': int32 [m, T], 'y': int32 [m, T]}`.

  Attributes:
    public_train: pretraining sequences.
    public_heldout: pretraining's held-out sequences.
    private_train: the private fine-tuning sequences (one per privacy unit).
    private_heldout: held-out sequences of the private domain.
    source: the corpus the texts came from, 'fortunes' or 'generated' (the
      fallback when the fortune files are absent).
  """

  public_train: dict
  public_heldout: dict
  private_train: dict
  private_heldout: dict
  source: str = 'generated'


class Pretrained(NamedTuple):
  """The pretrained model, split into its code, adapters and base.

  Attributes:
    graphdef: the model's code.
    adapters: its LoRA adapters (`lora_b` zero: they change nothing yet).
    base: every other parameter.
    rows: pretraining's metrics rows.
    perplexity: `perplexity(adapters, base)` on the private held-out text
      (jitted once, shared by every run).
  """

  graphdef: nnx.GraphDef
  adapters: PyTree
  base: PyTree
  rows: list
  perplexity: Callable[[PyTree, PyTree], jax.Array]


class LoraFinetuneResult(NamedTuple):
  """What `run` measured.

  Attributes:
    summary: one row per fine-tuning run and seed (the table of the
      results page).
    rows: every evaluation of every run (pretraining included).
    perplexity_before: the pretrained model's perplexity on the private
      held-out text.
  """

  summary: list
  rows: list
  perplexity_before: float


def load_corpora(config: ml_collections.ConfigDict) -> Corpora:
  """The public and private texts of the config, cut and split.

  Args:
    config: see `configs/lora_finetune.py`.

  With `corpus='fortunes'` and the fortune files absent (Debian's
  `fortunes` package not installed), the generated corpus is used instead,
  with a `UserWarning` saying so and how to get the fortunes; `source`
  records which one ran.

  Returns:
    The `Corpora`.

  Raises:
    ValueError: for an unknown `config.corpus`.
  """
  source = config.corpus
  if source == 'fortunes':
    try:
      public = text_data.read_fortunes(config.data_path, config.public_files)
      private = text_data.read_fortunes(config.data_path,
                                        config.private_files)
    except FileNotFoundError as missing:
      warnings.warn(
          f'{missing} Falling back to the generated corpus (as with '
          '--config.corpus=generated, which needs no install); its '
          'perplexities are not the fortunes\' of docs/lora_finetune.',
          UserWarning, stacklevel=2)
      source = 'generated'
  if source == 'generated':
    seed = quickstart.seed_for(config.seed, 'corpus')
    public = text_data.generated_corpus(config.public_domain,
                                        config.public_chars, seed)
    private = text_data.generated_corpus(config.private_domain,
                                         config.private_chars, seed + 1)
  elif source != 'fortunes':
    raise ValueError(f'corpus must be one of {CORPORA}, got '
                     f'{config.corpus!r}')
  split_seed = quickstart.seed_for(config.seed, 'split')
  public_train, public_heldout = text_data.split(
      text_data.sequences(text_data.encode(public), config.context),
      config.heldout_fraction, split_seed)
  private_train, private_heldout = text_data.split(
      text_data.sequences(text_data.encode(private), config.context),
      config.heldout_fraction, split_seed + 1)
  cap = lambda d: {k: v[:config.max_eval_sequences] for k, v in d.items()}
  return Corpora(public_train, cap(public_heldout), private_train,
                 cap(private_heldout), source)


def make_model(config: ml_collections.ConfigDict) -> models.Decoder:
  """The config's decoder, initialized from `config.seed`."""
  # Initialized in one compiled program rather than op by op.
  return nnx.jit(lambda: models.Decoder(
      text_data.VOCAB_SIZE, context=config.context, width=config.width,
      depth=config.depth, heads=config.heads, lora_rank=config.lora_rank,
      rngs=nnx.Rngs(quickstart.seed_for(config.seed, 'model'))))()


def _perplexity(graphdef: nnx.GraphDef, data: dict):
  """`perplexity(adapters, base)` on `data`, jitted."""
  mean_loss = lambda adapters, base: models.lm_mean_loss(graphdef, base)(
      adapters, data)
  return jax.jit(lambda adapters, base: jnp.exp(mean_loss(adapters, base)))


def _shuffled(num_examples: int, batch_size: int, num_steps: int,
              seed: int) -> tuple[Iterator[np.ndarray], int]:
  """`num_steps` batches of fresh shuffles (non-private runs), per epoch."""
  steps_per_epoch = num_examples // batch_size
  if steps_per_epoch < 1:
    raise ValueError(f'batch_size {batch_size} exceeds the {num_examples} '
                     'training sequences')
  sampler = batching.ShuffledBatches(
      num_examples, batch_size,
      num_epochs=math.ceil(num_steps / steps_per_epoch), seed=seed)
  return itertools.islice(iter(sampler), num_steps), steps_per_epoch


def pretrain(config: ml_collections.ConfigDict, corpora: Corpora
             ) -> Pretrained:
  """Trains the base model on the public text, without privacy.

  Args:
    config: see `configs/lora_finetune.py`.
    corpora: from `load_corpora`.

  Returns:
    The `Pretrained` model.
  """
  graphdef, base, adapters = models.split_trainable(make_model(config),
                                                    'base')
  public = _perplexity(graphdef, corpora.public_heldout)
  private = _perplexity(graphdef, corpora.private_heldout)
  batches, steps_per_epoch = _shuffled(
      len(corpora.public_train['x']), config.pretrain_batch_size,
      config.pretrain_steps, quickstart.seed_for(config.seed, 'pretrain'))
  result = spine.run_optimizer(
      'pretrain', optax.adam(config.pretrain_learning_rate),
      lambda b, batch: models.lm_mean_loss(graphdef, adapters)(b, batch),
      base, corpora.public_train, batches, num_steps=config.pretrain_steps,
      steps_per_epoch=steps_per_epoch,
      evaluate=lambda b: {'public_perplexity': public(adapters, b),
                          'private_perplexity': private(adapters, b)},
      eval_every=config.pretrain_eval_every)
  return Pretrained(graphdef, adapters, result.params, result.rows, private)


def _trained_and_frozen(finetune: str, pretrained: Pretrained):
  if finetune == 'lora':
    return pretrained.adapters, pretrained.base
  if finetune == 'full':
    return pretrained.base, pretrained.adapters
  raise ValueError(f'finetune must be one of {FINETUNE}, got {finetune!r}')


def _as_adapters_and_base(finetune: str, trained: PyTree, frozen: PyTree):
  return (trained, frozen) if finetune == 'lora' else (frozen, trained)


def finetune_private(config: ml_collections.ConfigDict, finetune: str,
                     clipping_method: str, seed: int, pretrained: Pretrained,
                     corpora: Corpora, noise_multiplier: Optional[float] = None
                     ) -> tuple[spine.RunResult, plans.Plan]:
  """Fine-tunes privately by a DP-SGD plan (one sequence per privacy unit).

  Args:
    config: see `configs/lora_finetune.py`.
    finetune: 'lora' (train the adapters) or 'full' (train the base).
    clipping_method: the plan's `clipping_method`.
    seed: seeds the batches and the noise (the same for every clipping
      method).
    pretrained: from `pretrain`.
    corpora: from `load_corpora`.
    noise_multiplier: the noise of a plan already calibrated to the same
      (epsilon, delta, data size, batches), to skip calibrating it again
      (None: calibrate to `config.epsilon`).

  Returns:
    The run's result and its plan.
  """
  if clipping_method not in CLIPPING_METHODS:
    raise ValueError(f'clipping_method must be one of {CLIPPING_METHODS}, '
                     f'got {clipping_method!r}')
  trained, frozen = _trained_and_frozen(finetune, pretrained)
  name = f'{finetune}/dp/{clipping_method}'
  # The batches and the noise depend on the seed and the fine-tuning kind,
  # NOT on the clipping method: 'auto' and 'vmap' compute the same clipped
  # sums, so their runs see the same batches and noise and differ only by
  # float rounding. The key is given again on purpose (KeyReuseWarning
  # silenced): one comparison of two paths, not two releases.
  batch_seed, noise_seed = (quickstart.seed_for(seed, f'{finetune}/dp/batches'),
                            quickstart.seed_for(seed, f'{finetune}/dp/noise'))
  with warnings.catch_warnings():
    warnings.simplefilter('ignore', keys.KeyReuseWarning)
    plan = plans.dpsgd(
      models.lm_example_loss(pretrained.graphdef, frozen),
        optimizer=optax.adam(config.learning_rates[finetune]),
        num_examples=len(corpora.private_train['x']),
        batch_size=config.batch_size, epochs=config.epochs,
        l2_clip=config.clip, delta=config.delta, method=config.accounting,
        **({'epsilon': config.epsilon} if noise_multiplier is None else
           {'noise_multiplier': noise_multiplier}),
        seed=batch_seed, key=jax.random.key(noise_seed),
        clipping_method=clipping_method)
  perplexity = pretrained.perplexity
  result = spine.run_plan(
      name, plan, trained, corpora.private_train, eval_every=config.eval_every,
      evaluate=lambda p: {'private_perplexity': perplexity(
          *_as_adapters_and_base(finetune, p, frozen))})
  return result, plan


def finetune_nonprivate(config: ml_collections.ConfigDict, finetune: str,
                        seed: int, pretrained: Pretrained, corpora: Corpora
                        ) -> spine.RunResult:
  """The same fine-tuning without privacy: Adam on shuffled batches.

  It takes as many steps of `config.batch_size` sequences as the private
  run expects to.

  Args:
    config: see `configs/lora_finetune.py`.
    finetune: 'lora' or 'full'.
    seed: seeds the batches.
    pretrained: from `pretrain`.
    corpora: from `load_corpora`.

  Returns:
    The run's result.
  """
  trained, frozen = _trained_and_frozen(finetune, pretrained)
  n = len(corpora.private_train['x'])
  num_steps = round(config.epochs * n / config.batch_size)
  batches, steps_per_epoch = _shuffled(
      n, config.batch_size, num_steps,
      quickstart.seed_for(seed, f'{finetune}/nonprivate/batches'))
  perplexity = pretrained.perplexity
  return spine.run_optimizer(
      f'{finetune}/nonprivate', optax.adam(config.learning_rates[finetune]),
      models.lm_mean_loss(pretrained.graphdef, frozen), trained,
      corpora.private_train, batches, num_steps=num_steps,
      steps_per_epoch=steps_per_epoch, eval_every=config.eval_every,
      evaluate=lambda p: {'private_perplexity': perplexity(
          *_as_adapters_and_base(finetune, p, frozen))})


def _num_params(tree: PyTree) -> int:
  return int(sum(np.size(leaf) for leaf in jax.tree_util.tree_leaves(tree)))


def _check(config: ml_collections.ConfigDict) -> None:
  for finetune in config.finetune:
    if finetune not in FINETUNE:
      raise ValueError(f'finetune entries must be in {FINETUNE}, got '
                       f'{finetune!r}')
    if finetune not in config.learning_rates:
      raise ValueError(f'learning_rates has no rate for {finetune!r}')
  for method in config.clipping_methods:
    if method not in CLIPPING_METHODS:
      raise ValueError(f'clipping_methods entries must be in '
                       f'{CLIPPING_METHODS}, got {method!r}')
  if not config.seeds:
    raise ValueError('seeds must list at least one seed')


def _plot(path: str, rows: list, before: float, title: str) -> None:
  """Held-out perplexity over fine-tuning epochs: seeds' mean and range."""
  curves = []
  for name in dict.fromkeys(r['algorithm'] for r in rows
                            if r['algorithm'] != 'pretrain'):
    runs = {}
    for r in rows:
      if r['algorithm'] == name:
        runs.setdefault(r['seed'], []).append(r)
    length = min(len(v) for v in runs.values())
    values = np.array([[r['private_perplexity'] for r in v[:length]]
                       for v in runs.values()])
    epochs = [r['epoch'] for r in next(iter(runs.values()))[:length]]
    curves.append(outputs.Curve(name, epochs, values.mean(0), values.min(0),
                                values.max(0)))
  if curves:
    last = max(c.x[-1] for c in curves)
    curves.append(outputs.Curve('pretrained (before fine-tuning)', [0, last],
                                [before, before]))
  outputs.plot_curves(path, curves, xlabel='fine-tuning epoch',
                      ylabel='held-out perplexity (private domain)',
                      title=title)


def run(config: ml_collections.ConfigDict,
        output_dir: str) -> LoraFinetuneResult:
  """Pretrains, fine-tunes privately and not, and writes the outputs.

  Example:
    >>> from configs import lora_finetune
    >>> result = run(lora_finetune.get_config(), 'results/lora_finetune')
    >>> result.summary[0]['perplexity_after']

  Args:
    config: see `configs/lora_finetune.py`.
    output_dir: created if missing.

  Returns:
    The `LoraFinetuneResult`.

  Raises:
    ValueError: for an unknown corpus, fine-tuning kind or clipping method.
  """
  start = time.perf_counter()
  _check(config)
  corpora = load_corpora(config)
  pretrained = pretrain(config, corpora)
  rows = [dict(r, seed=config.seed) for r in pretrained.rows]
  before = float(pretrained.perplexity(pretrained.adapters, pretrained.base))
  summary, privacy = [], []
  # Every private run has the same data size, batches and target: the
  # first plan's calibrated noise serves the others.
  noise_multiplier = None
  for seed in config.seeds:
    for finetune in config.finetune:
      trained, _ = _trained_and_frozen(finetune, pretrained)
      common = {'finetune': finetune, 'seed': seed,
                'trainable_params': _num_params(trained),
                'perplexity_before': before}
      for method in config.clipping_methods:
        t0 = time.perf_counter()
        result, plan = finetune_private(config, finetune, method, seed,
                                        pretrained, corpora, noise_multiplier)
        noise_multiplier = plan.noise_multiplier
        rows += [dict(r, seed=seed) for r in result.rows]
        privacy.append(spine.privacy_entry(f'{finetune}/dp/{method}/{seed}',
                                           plan))
        summary.append({
            'run': f'{finetune}/dp/{method}', **common, 'private': True,
            'clipping_method': method,
            'clipping_path': plan.describe()['clipping_path'],
            'epsilon': plan.epsilon,
            'delta': plan.delta, 'noise_multiplier': plan.noise_multiplier,
            'steps': plan.num_steps,
            'perplexity_after': result.rows[-1]['private_perplexity'],
            'wall_seconds': time.perf_counter() - t0})
      if config.nonprivate:
        t0 = time.perf_counter()
        result = finetune_nonprivate(config, finetune, seed, pretrained,
                                     corpora)
        rows += [dict(r, seed=seed) for r in result.rows]
        summary.append({
            'run': f'{finetune}/nonprivate', **common, 'private': False,
            'clipping_method': None, 'clipping_path': None,
            'epsilon': math.inf, 'delta': None,
            'noise_multiplier': 0.0, 'steps': result.last_step,
            'perplexity_after': result.rows[-1]['private_perplexity'],
            'wall_seconds': time.perf_counter() - t0})
  os.makedirs(output_dir, exist_ok=True)
  outputs.write_csv(os.path.join(output_dir, 'summary.csv'), summary)
  outputs.write_csv(os.path.join(output_dir, 'metrics.csv'), rows)
  _plot(os.path.join(output_dir, 'perplexity.png'),
        [r for r in rows if r['algorithm'] != 'pretrain'], before,
        f'{corpora.source}: private fine-tuning at '
        f'epsilon={config.epsilon:g}, '
        f'delta={config.delta:g} ({len(config.seeds)} seeds)')
  outputs.write_json(
      os.path.join(output_dir, 'run_record.json'),
      outputs.run_record(
          config, privacy=privacy, wall_seconds=time.perf_counter() - start,
          extra={'experiment': 'experiments.lora_finetune',
                 'corpus': corpora.source,
                 'sequences': {k: len(v['x'])
                               for k, v in corpora._asdict().items()
                               if k != 'source'},
                 'perplexity_before': before}))
  return LoraFinetuneResult(summary, rows, before)


if __name__ == '__main__':
  cli.launch(run, 'configs/lora_finetune.py',
             'Private LoRA fine-tuning of a small decoder language model',
             output_dir='results/lora_finetune')
