"""What every stored image says of its origin: an XMP packet with the IPTC digital source type of AI-made media
(`trainedAlgorithmicMedia`), the model that made it and the image's fingerprints (transforms/fingerprints.py).

PNG carries it in the standard `XML:com.adobe.xmp` iTXt chunk, WebP and JPEG in their XMP chunk / APP1 segment,
beside the prompt and parameter text they already carry (transforms/sinks/encoding.py). Optional C2PA signing of
the same claim lives in transforms/c2pa_signing.py. Pure functions: no Beam, no I/O.
"""

from __future__ import annotations

from xml.sax.saxutils import escape, quoteattr

DIGITAL_SOURCE_TYPE = "http://cv.iptc.org/newscodes/digitalsourcetype/trainedAlgorithmicMedia"
PNG_XMP_KEY = "XML:com.adobe.xmp"  # the iTXt keyword XMP readers look for in a PNG
IPTC_EXT_NS = "http://iptc.org/std/Iptc4xmpExt/2008-02-29/"
XMP_NS = "http://ns.adobe.com/xap/1.0/"
JOB_NS = "urn:flux2-klein-beam:provenance:1"  # this job's own properties (the fingerprints)
CREATOR_TOOL = "flux2-klein-beam"


def xmp_packet(*, model: str, request_fingerprint: str, model_fingerprint: str | None = None,
               image_id: str | None = None) -> str:
    """The XMP packet of one image: IPTC DigitalSourceType and AISystemUsed (the model), xmp:CreatorTool, and the
    request and model fingerprints (and the record's id) in this job's namespace. Every value is XML-escaped: a
    model path or an id is user text."""
    props = {"Iptc4xmpExt:DigitalSourceType": DIGITAL_SOURCE_TYPE, "Iptc4xmpExt:AISystemUsed": model,
             "xmp:CreatorTool": CREATOR_TOOL, "flux2:RequestFingerprint": request_fingerprint}
    if model_fingerprint:
        props["flux2:ModelFingerprint"] = model_fingerprint
    if image_id is not None:
        props["flux2:Id"] = image_id
    attributes = "".join(f"\n    {name}={quoteattr(str(value))}" for name, value in props.items())
    return ('<?xpacket begin="\ufeff" id="W5M0MpCehiHzreSzNTczkc9d"?>\n'
            '<x:xmpmeta xmlns:x="adobe:ns:meta/">\n'
            ' <rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#">\n'
            f'  <rdf:Description rdf:about=""\n    xmlns:Iptc4xmpExt="{IPTC_EXT_NS}"\n    xmlns:xmp="{XMP_NS}"\n'
            f'    xmlns:flux2="{escape(JOB_NS)}"{attributes}/>\n'
            ' </rdf:RDF>\n'
            '</x:xmpmeta>\n'
            '<?xpacket end="w"?>')


def read_xmp(image) -> dict[str, str]:
    """The provenance properties of an open PIL image's XMP ({'DigitalSourceType': ..., 'AISystemUsed': ...,
    'RequestFingerprint': ...}, by local name); {} when it has none."""
    import xml.etree.ElementTree as ElementTree

    raw = image.info.get("xmp") or image.info.get(PNG_XMP_KEY) or getattr(image, "text", {}).get(PNG_XMP_KEY)
    if not raw:
        return {}
    if isinstance(raw, bytes):
        raw = raw.decode("utf-8")
    body = raw[raw.index("<x:xmpmeta"):raw.rindex("</x:xmpmeta>") + len("</x:xmpmeta>")]
    out = {}
    for element in ElementTree.fromstring(body).iter():
        for name, value in element.attrib.items():
            if name.startswith("{") and not name.startswith("{http://www.w3.org/1999/02/22-rdf-syntax-ns#"):
                out[name.split("}", 1)[1]] = value
    return out
