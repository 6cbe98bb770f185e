"""Private LoRA fine-tuning of a decoder LM, on tiny generated text."""

import json
import os
import warnings

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import lora_finetune as lora_finetune_config
from experiments import lora_finetune
from experiments import models
from experiments import outputs
from experiments import text_data


def tiny_config():
  config = lora_finetune_config.get_config()
  config.corpus = 'generated'
  config.public_chars = config.private_chars = 4000
  config.context = 16
  config.width, config.depth, config.heads, config.lora_rank = 16, 1, 2, 2
  config.pretrain_steps, config.pretrain_batch_size = 20, 32
  config.pretrain_eval_every = 20
  config.finetune = ('lora',)
  config.batch_size, config.epochs, config.eval_every = 32, 2, 100
  config.learning_rates.lora = 0.03
  config.accounting = 'rdp'      # calibrates faster than 'pld'
  config.seeds = (0,)
  # The default path end to end, and per-example gradients beside it.
  config.clipping_methods = ('auto', 'vmap')
  return config


def test_pretrain_then_finetune_privately_end_to_end(tmp_path):
  config = tiny_config()
  with warnings.catch_warnings():
    warnings.simplefilter('ignore')
    result = lora_finetune.run(config, str(tmp_path))
  runs = {row['run']: row for row in result.summary}
  assert set(runs) == {'lora/dp/auto', 'lora/dp/vmap', 'lora/nonprivate'}
  private, reference = runs['lora/dp/auto'], runs['lora/nonprivate']
  # 'auto' and 'vmap' compute the same clipped sums on the same batches
  # with the same noise: the runs coincide up to float rounding, whichever
  # path 'auto' took (recorded per row).
  vmapped = runs['lora/dp/vmap']
  assert vmapped['clipping_path'] == 'vmap'
  assert private['clipping_path'] in ('ghost', 'vmap')
  assert vmapped['perplexity_after'] == pytest.approx(
      private['perplexity_after'], rel=1e-3)
  assert vmapped['perplexity_after'] != pytest.approx(
      private['perplexity_before'], rel=1e-3)
  assert 7.9 < private['epsilon'] <= config.epsilon + 1e-9
  assert private['noise_multiplier'] > 0
  # Only the adapters are trained: 2 r (d + d_out) per dense layer.
  assert private['trainable_params'] == 2 * (4 * (16 + 16) + (16 + 64)
                                             + (64 + 16))
  before = result.perplexity_before
  # Pretraining on another domain leaves the private text far from learned.
  assert 1.0 < before < text_data.VOCAB_SIZE
  for row in runs.values():
    assert np.isfinite(row['perplexity_after'])
    assert row['perplexity_before'] == before
  # Fine-tuning on the private domain helps, without privacy for sure.
  assert reference['perplexity_after'] < 0.9 * before, reference
  rows = outputs.read_csv(str(tmp_path / 'metrics.csv'))
  assert {r['algorithm'] for r in rows} == {'pretrain', 'lora/dp/auto',
                                            'lora/dp/vmap', 'lora/nonprivate'}
  assert os.path.getsize(tmp_path / 'perplexity.png') > 0
  with open(tmp_path / 'run_record.json') as f:
    record = json.load(f)
  assert record['privacy'][0]['epsilon_spent'] == pytest.approx(
      private['epsilon'])
  assert record['corpus'] == 'generated'
  assert record['perplexity_before'] == pytest.approx(before)


def test_lm_loss_trains_only_the_selected_parameters():
  # Built and evaluated in compiled programs: op by op, each op compiles.
  model = nnx.jit(lambda: models.Decoder(
      text_data.VOCAB_SIZE, context=8, width=8, depth=1, heads=2,
      lora_rank=2, rngs=nnx.Rngs(0)))()
  graphdef, adapters, base = models.split_trainable(model, nnx.LoRAParam)
  _, base_again, adapters_again = models.split_trainable(model, 'base')
  assert jax.tree.structure(base) == jax.tree.structure(base_again)
  assert jax.tree.structure(adapters) == jax.tree.structure(adapters_again)
  tokens = jnp.asarray(text_data.encode('the soup is hot!'))
  example = {'x': tokens[:8], 'y': tokens[1:9]}
  changed = example['x'].at[5].set(0)

  @jax.jit
  def check(adapters, base):
    loss_fn = models.lm_example_loss(graphdef, base)
    logits = lambda x: nnx.merge(graphdef, adapters, base)(x[None])[0]
    return (loss_fn(adapters, example),
            models.lm_example_loss(graphdef, adapters)(base, example),
            jax.grad(loss_fn)(adapters, example),
            logits(example['x']), logits(changed))

  loss, same_loss, grads, logits, logits_changed = check(adapters, base)
  assert loss.shape == ()
  # A fresh adapter (lora_b = 0) leaves the base model's outputs alone, and
  # the two splits are the same model.
  assert loss == pytest.approx(float(same_loss))
  assert jax.tree.leaves(grads) and all(
      bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))
  # Causal: changing token 5 moves no output before position 5.
  assert jnp.allclose(logits[:5], logits_changed[:5], atol=1e-5)
  assert not jnp.allclose(logits[5:], logits_changed[5:], atol=1e-5)
  with pytest.raises(ValueError, match='selects no parameter'):
    models.split_trainable(model, nnx.BatchStat)
  with pytest.raises(ValueError, match='exceed the context'):
    jax.eval_shape(model, jnp.zeros((1, 9), jnp.int32))


def test_text_data_windows_vocabulary_and_corpora():
  assert text_data.decode(text_data.encode('Hi!\n')) == 'Hi!\n'
  assert text_data.decode(text_data.encode('\tcaf\u00e9')) == ' caf?'
  data = text_data.sequences(text_data.encode('abcdefghijk'), context=4)
  # Non-overlapping windows of T + 1 tokens, targets shifted by one.
  assert [text_data.decode(x) for x in data['x']] == ['abcd', 'fghi']
  assert [text_data.decode(y) for y in data['y']] == ['bcde', 'ghij']
  train, heldout = text_data.split(
      text_data.sequences(text_data.encode('x' * 1000), 9), 0.1, seed=0)
  assert (len(train['x']), len(heldout['x'])) == (90, 10)
  kitchen = text_data.generated_corpus('kitchen', 500, seed=0)
  assert len(kitchen) == 500 and 'weather' not in kitchen
  assert kitchen == text_data.generated_corpus('kitchen', 500, seed=0)
  with pytest.raises(ValueError, match='domain'):
    text_data.generated_corpus('sports', 10, seed=0)
  with pytest.raises(ValueError, match='no window'):
    text_data.sequences(text_data.encode('abc'), context=4)
  with pytest.raises(ValueError, match='heldout_fraction'):
    text_data.split(data, 1.0, seed=0)


def test_read_fortunes_drops_separators_and_says_how_to_install(tmp_path):
  (tmp_path / 'jokes').write_text('A joke.\n%\nAnother\njoke.\n%\n')
  text = text_data.read_fortunes(str(tmp_path), ['jokes'])
  assert '%' not in text and 'A joke.' in text and 'Another\njoke.' in text
  with pytest.raises(FileNotFoundError, match='apt-get install fortunes'):
    text_data.read_fortunes(str(tmp_path), ['missing'])


def test_config_errors_are_clear(tmp_path):
  config = tiny_config()
  config.finetune = ('prefix',)
  with pytest.raises(ValueError, match='finetune'):
    lora_finetune.run(config, str(tmp_path))
  config = tiny_config()
  config.clipping_methods = ('ghosts',)
  with pytest.raises(ValueError, match='clipping_methods'):
    lora_finetune.run(config, str(tmp_path))



def test_missing_fortunes_fall_back_to_the_generated_corpus(tmp_path):
  # The default corpus on a machine without Debian's fortunes package.
  config = tiny_config()
  config.corpus, config.data_path = 'fortunes', str(tmp_path / 'nowhere')
  with pytest.warns(UserWarning, match='--config.corpus=generated') as caught:
    corpora = lora_finetune.load_corpora(config)
  assert 'apt-get install fortunes' in str(caught[0].message)
  assert corpora.source == 'generated'
  config.corpus = 'generated'
  generated = lora_finetune.load_corpora(config)
  np.testing.assert_array_equal(corpora.private_train['x'],
                                generated.private_train['x'])
