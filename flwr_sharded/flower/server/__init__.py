"""The ServerApp's side: the strategies (`strategy`, `server_path`), who takes part (`membership`), bounded exchange
with the Grid (`grid`), round records (`records`), the ServerApp around its strategy (`app`), and the server path's
stream and aggregator (`stream`, `aggregation`)."""
