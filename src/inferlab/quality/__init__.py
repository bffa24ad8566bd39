"""Model quality on a text: perplexity and KL divergence against a base model (`inferlab perplexity`)."""
