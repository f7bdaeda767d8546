"""consumer-kit's own text on the wire and on screens: headers, marks, the envelope, strict JSON, redaction."""
