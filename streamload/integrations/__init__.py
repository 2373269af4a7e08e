"""integrations: from_pretrained and framework drop-ins (verl, accelerate, ...)."""
