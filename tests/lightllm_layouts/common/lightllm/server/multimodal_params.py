# Shape of lightllm/server/multimodal_params.py @ fc72ffab: a plain class (no __setstate__),
# pickled by value on every hop; InferReq.init_all() replaces it by to_dict().


class MultimodalParams:
    def __init__(self, images=[], audios=[]):
        self.images = list(images)
        self.audios = list(audios)

    def to_dict(self):
        return {"images": [dict(i) for i in self.images], "audios": [dict(a) for a in self.audios]}
