"""Where the repository is, for tests that run its commands or read its files (tests sit two folders down)."""

import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
