"""The pure core: records, the correlator, the codec interface, errors. No I/O library is imported
here (tests/test_layout.py enforces it): messages and time go in, decisions come out."""
