"""SmolLM2-135M-Instruct's EAGLE-3 head in one command: the target's answers to the chat
instructions (scripts/chat_answers.py), then features, training and export
(scripts/train_eagle.py) into the cache folder, where benchmarks/smollm2_eagle_chat.py and
tests/test_gguf_smollm2.py look for it. Each step is a command of its own, recorded in the
head's training.json; a run cut short can be started again (the answers resume).

    python scripts/train_smollm2_eagle.py [--run runs/smollm2] [--threads 1] [--minutes 22]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from scripts.fetch_smollm2 import eagle_head_dir, fetch_smollm2

SCRIPTS = Path(__file__).resolve().parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", default="runs/smollm2", help="answers, features, checkpoints, logs")
    ap.add_argument("--export", default=str(eagle_head_dir()))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--minutes", type=float, default=22.0, help="training time")
    ap.add_argument("--draft-vocab", type=int, default=16384)
    a = ap.parse_args()
    run = Path(a.run)
    threads = ["--threads", str(a.threads)]
    steps = [
        ["chat_answers.py", "--out", str(run / "chat.jsonl"), *threads],
        ["train_eagle.py", "--target", str(fetch_smollm2()), "--chat-data",
         str(run / "chat.jsonl"), "--draft-vocab", str(a.draft_vocab), "--out", str(run),
         "--export", a.export, "--batch-size", "16", "--noise", "0", "--steps", "20000",
         "--minutes", str(a.minutes), "--eval-every", "50", *threads],
    ]  # fmt: skip
    for step in steps:
        print("+ python scripts/" + " ".join(step), flush=True)
        if subprocess.run([sys.executable, str(SCRIPTS / step[0]), *step[1:]]).returncode:
            return 1
    print(a.export)
    return 0


if __name__ == "__main__":
    sys.exit(main())
