"""Zero-shot evaluation: language-model perplexity over a text file (WIKITEXT103) and cloze
accuracy on LAMBADA-format passages (LAMBADA)."""
