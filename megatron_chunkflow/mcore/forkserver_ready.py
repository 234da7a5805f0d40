"""Imported last by the fork server of mcore/dist.py (PRELOAD): what it imported is moved out of
the garbage collector's reach (gc.freeze) before any rank is forked, so a rank's collections do
not touch, and copy on write, the pages of every object it inherited."""

import gc

gc.collect()
gc.freeze()
