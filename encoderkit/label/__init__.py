"""Label texts with a general-purpose model (an OpenAI-compatible endpoint) or an offline encoder
(embedding zero-shot, MLM cloze), audit a sample by hand, and decide whether a fine-tuned encoder
should replace the labeller.

``encoderkit label`` writes ``labeled.jsonl``; ``encoderkit audit suspect|sample|review|report``
finds likely label errors, builds and fills a review sheet, and reports accuracy with Wilson
intervals and the cost per million requests; ``encoderkit finetune --train labeled.jsonl`` trains
on the labels with the audited corrections applied.
"""
