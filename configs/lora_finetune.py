"""Config of `experiments/lora_finetune.py`: private LoRA fine-tuning of a decoder LM.

The default is the results run (docs/lora_finetune): Debian's fortunes
(`apt-get install fortunes`), general topics public, the 'computers' topic
private. A tiny run on generated text needs no install:

    python -m experiments.lora_finetune --config.corpus=generated \
        --config.pretrain_steps=50 --config.seeds="(0,)"
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  """Returns the default config."""
  config = ml_collections.ConfigDict()
  # Text: 'fortunes' (Debian's fortune files, read from data_path) or
  # 'generated' (sentences of a small grammar, nothing to install).
  config.corpus = 'fortunes'
  # The folder of the fortune files.
  config.data_path = '/usr/share/games/fortunes'
  # Fortune topics of the public (pretraining) text.
  config.public_files = ('art', 'cookie', 'definitions', 'drugs', 'education',
                         'ethnic', 'food', 'fortunes', 'goedel', 'humorists',
                         'kids', 'law', 'literature', 'love', 'magic',
                         'medicine', 'men-women', 'miscellaneous', 'news',
                         'people', 'pets', 'platitudes', 'politics',
                         'riddles', 'science', 'songs-poems', 'sports',
                         'startrek', 'translate-me', 'wisdom', 'work',
                         'paradoxum', 'pratchett', 'tao',
                         'zippy')
  # Fortune topics of the private text (a domain held apart from the public
  # one: no computing topic is public).
  config.private_files = ('computers',)
  # Generated corpus ('weather' or 'kitchen'): the public domain.
  config.public_domain = 'weather'
  config.private_domain = 'kitchen'  # Generated corpus: the private domain.
  config.public_chars = 20_000  # Generated corpus: public characters.
  config.private_chars = 20_000  # Generated corpus: private characters.
  # Tokens per sequence T (one sequence is one privacy unit).
  config.context = 64
  # Share of each text's sequences held out for the perplexity.
  config.heldout_fraction = 0.1
  # Evaluate on at most this many held-out sequences.
  config.max_eval_sequences = 512
  config.width = 64  # Decoder width d.
  config.depth = 2  # Decoder blocks.
  config.heads = 4  # Attention heads per block.
  config.lora_rank = 4  # Rank of the LoRA adapters of every dense layer.
  # Pretraining (non-private, Adam on shuffled batches): steps.
  config.pretrain_steps = 300
  config.pretrain_batch_size = 64  # Pretraining batch size.
  config.pretrain_learning_rate = 3e-3  # Pretraining Adam learning rate.
  config.pretrain_eval_every = 100  # Pretraining evaluation interval.
  # Fine-tuning runs: 'lora' (adapters on the frozen base) and/or 'full'
  # (every base parameter).
  config.finetune = ('lora', 'full')
  # Clipping methods of the private runs (dpsco_jax.plans.dpsgd's
  # clipping_method): 'auto' (the default: ghost norms where they are
  # cheaper, by the cost model) and 'vmap' (per-example gradients).
  config.clipping_methods = ('auto', 'vmap')
  # Also fine-tune without privacy (the reference).
  config.nonprivate = True
  # Privacy target of each private run (one sequence per privacy unit).
  config.epsilon = 8.0
  # delta (below 1 / the number of private training sequences).
  config.delta = 1e-5
  # Accounting method ('pld' or 'rdp', dpsco_jax.accounting.METHODS); the
  # noise is calibrated once and shared by every private run.
  config.accounting = 'pld'
  # Per-sequence l2 clip norm.
  config.clip = 1.0
  # Adam learning rate of each fine-tuning kind (private and not).
  config.learning_rates = ml_collections.ConfigDict({'lora': 1e-2,
                                                     'full': 1e-3})
  # Expected batch size of the private runs (Poisson sampling; the
  # non-private runs take batches of this size).
  config.batch_size = 128
  config.epochs = 1  # Passes over the private training sequences.
  # Evaluate every this many fine-tuning steps (and at the start and end).
  config.eval_every = 5
  # Fine-tuning seeds (batches and noise); pretraining uses `seed`.
  config.seeds = (0, 1, 2)
  # Seeds the corpus split, the model's initialization and pretraining.
  config.seed = 0
  return config
