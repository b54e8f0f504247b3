# Shape of lightllm/utils/dist_utils.py @ fc72ffab: get_current_rank_in_dp() of this worker.
import os


def get_current_rank_in_dp():
    return int(os.environ.get("STANDIN_RANK_IN_DP", "0"))
