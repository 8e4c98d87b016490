"""`python -m fibray.generate`: write LLM-serving workloads for the datasets/llm contracts."""

import sys

from fibray.generate.llm import main

sys.exit(main())
