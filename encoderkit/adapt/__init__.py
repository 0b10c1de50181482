"""``encoderkit adapt``: domain adaptation of a bi-encoder to a corpus without labels.

Generated queries (:mod:`~encoderkit.adapt.queries`), hard negatives mined with the model being adapted
(:mod:`~encoderkit.adapt.negatives`), then ``finetune --task embed`` on them (MarginMSE on a cross-encoder's
margins, as GPL does, when one is given). The stage: :mod:`~encoderkit.adapt.run`.
"""
