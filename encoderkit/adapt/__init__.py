"""``encoderkit adapt``: domain adaptation of a bi-encoder to a corpus without labels.

Queries are generated per passage (an OpenAI-compatible endpoint through the labeller's client and cache,
or offline from the passage itself: :mod:`~encoderkit.adapt.queries`), hard negatives are mined with the
model being adapted (:mod:`~encoderkit.adapt.negatives`), and the model is fine-tuned on (query, passage,
negatives) by ``finetune --task embed`` (in-batch negatives; with a cross-encoder, MarginMSE on its score
margins, as GPL does). The stage itself: :mod:`~encoderkit.adapt.run`.
"""
