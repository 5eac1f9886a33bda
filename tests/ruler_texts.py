"""Text for the RULER tests (tests/tools/eval/test_ruler_data.py, tests/tools/eval/tasks/test_ruler.py):
a pseudo-word vocabulary, two long texts and question-answer rows, the same on every import."""

from __future__ import annotations

import random
import string

# one pseudo-word vocabulary big enough for every generator (cwe draws hundreds of distinct words)
RNG = random.Random(7)
VOCAB = sorted({"".join(RNG.choices(string.ascii_lowercase, k=RNG.randint(4, 8))) for _ in range(1500)})
TEXTS = [" ".join(RNG.choice(VOCAB) + ("." if RNG.random() < 0.1 else "") for _ in range(3000)) for _ in range(2)]
QA_ROWS = [{"question": f"what is item {i}?", "answers": [f"answer{i}x"], "title": f"Item {i}",
             "text": f"Item {i} is known as answer{i}x. " + " ".join(RNG.choice(VOCAB) for _ in range(60))}
            for i in range(40)]
