"""The ServerApp's side: the strategies (`strategy`; the server path's, `server_path_strategy`), who takes part
(`membership`), bounded exchange with the Grid (`grid`), round records (`records`), the ServerApp around its strategy
(`app`), and the server path's stream and aggregator (`stream`, `aggregation`)."""
