"""encoderkit: pretrain, fine-tune, compress and deploy encoder language models on your own hardware."""

__version__ = "0.1.0"
