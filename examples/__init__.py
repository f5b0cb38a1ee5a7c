"""dstrain examples; entry points here are named from the repository root, e.g. examples.bert_mlm.bert:build."""
