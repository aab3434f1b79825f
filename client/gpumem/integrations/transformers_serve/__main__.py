"""``python -m gpumem.integrations.transformers_serve``: see the package's docstring."""

import sys

from gpumem.integrations.transformers_serve import main

sys.exit(main())
