"""The table of TorchRec sparse modules (docs/models.md) and sharding types, rendered from what the tests
cover: the parity harness's cases (plain EmbeddingBagCollections and EmbeddingCollections through
the lifted executor) and the user-model tests of the other collections. ``python tests/support_table.py`` prints it;
``tests/unit/test_support_table.py`` fails when the copy in docs/models.md differs."""

from __future__ import annotations

import sys
from pathlib import Path

# (run as a script: the shared helpers beside it, and the user-model tests whose cases it renders)
sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parent / "ranks")]

BEGIN, END = "<!-- support table: python tests/support_table.py -->", "<!-- end of support table -->"


def rows() -> list[tuple[str, str, str]]:
    import lifted_parity as lp
    from test_user_models import (
        LIFTED_COLLECTIONS, MANAGED_COLLECTIONS, OTHER_COLLECTIONS, SEVERAL_HOSTS, VARIABLE_BATCH,
    )

    lifted = [("EmbeddingBagCollection", kind,
               "sharded; lifted; bit-identical to TorchRec on 1-3 ranks with every pass forced on "
               "(`tests/ranks/test_lifting.py`)")
              for kind, case in lp.CASES.items() if kind in lp.POOLED_CASES and len(set(case["sharding"].values())) == 1]
    mean = lp.CASES["mean_pooling"]
    lifted.append(("EmbeddingBagCollection, mean pooling",
                   ", ".join(sorted({mean["sharding"][t] for t in mean["mean"]})),
                   "sharded; lifted (row-wise: TorchRec's division by bag lengths after the reduce-scatter); "
                   "bit-identical to TorchRec on 1-3 ranks with every pass forced on (`tests/ranks/test_lifting.py`)"))
    kept, *others = SEVERAL_HOSTS
    lifted.append(("EmbeddingBagCollection, several hosts", kept,
                   f"sharded; that group runs TorchRec's input dist, lookup and output dist inside the lifted module, "
                   f"whose other groups ({', '.join(others)}, table_wise) are lifted; bit-identical to TorchRec with "
                   f"every pass forced on, 2 ranks of one host each (`tests/ranks/test_user_models.py`); a module of only "
                   f"such groups keeps TorchRec's path"))
    # per sharding type, the parity variants of module "a" as an EmbeddingCollection
    sequence: dict[str, list[dict]] = {}
    for variant in lp.VARIANTS.values():
        for case in variant.get("sequence", ()):
            sequence.setdefault(case, []).append(variant)
    for kind in sorted(k for k in sequence if len(set(lp.CASES[k]["sharding"].values())) == 1):
        one_id = all(not v["multi_hot"] for v in sequence[kind])
        lifted.append(("EmbeddingCollection", kind,
                       "sharded; lifted; bit-identical to TorchRec on 1-3 ranks with every pass forced on, alone "
                       "and next to an EmbeddingBagCollection (`tests/ranks/test_lifting.py`, `tests/ranks/test_user_models.py`)"
                       + ("; on CPU one id per bag: TorchRec's data-parallel lookup (fbgemm's dense kernel) pools "
                          "longer bags there, which the input checks refuse" if one_id else "")))
    other = [(collection, kind, "sharded; TorchRec's path (not lifted, the reason in `explain()`); bit-identical "
                                "next to a lifted EmbeddingBagCollection (`tests/ranks/test_user_models.py`)")
             for collection, kind in sorted(OTHER_COLLECTIONS) if collection not in LIFTED_COLLECTIONS]
    managed = [(collection, kind, "sharded (row-wise only, as TorchRec allows; on CPU with SGD or Adagrad); "
                                  "TorchRec's path; bit-identical next to a lifted EmbeddingBagCollection, exact "
                                  "resume (`tests/ranks/test_user_models.py`, `tests/ranks/test_checkpoint.py`)")
               for collection, kind in sorted(MANAGED_COLLECTIONS)]
    variable = [("EmbeddingBagCollection, variable batch per feature (VBE)", kind,
                 "sharded; TorchRec's path (the lifted executor takes no VBE; the reason in `explain()`); "
                 "bit-identical to `executor=\"torchrec\"` (`tests/ranks/test_user_models.py`), exact resume "
                 "(`tests/ranks/test_checkpoint.py`, table-wise); `data_parallel` "
                 "refused on CPU by the input checks (TorchRec's data-parallel lookup reads VBE batches wrong there)")
                for kind in VARIABLE_BATCH]
    return lifted + other + managed + variable


def markdown() -> str:
    lines = ["| TorchRec module | sharding type | what the tests show |", "|---|---|---|"]
    lines += [f"| `{module}` | `{kind}` | {status} |" for module, kind, status in rows()]
    return "\n".join([BEGIN, *lines, END])


if __name__ == "__main__":
    print(markdown())
