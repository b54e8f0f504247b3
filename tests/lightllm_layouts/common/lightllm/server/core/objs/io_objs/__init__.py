from .group_req import GroupReqIndexes, GroupReqObjs  # noqa: F401
