# Task fix-service: the service answers 404 for every account: its route only accepts letters.
ARG BASE=tvcache-base:bookworm
FROM ${BASE}
COPY ledger /srv/ledger
WORKDIR /srv/ledger
# The data set, and the checksum of the balances a correct build computes from it.
RUN chmod +x *.sh serve.pl && mkdir data && ./gen-data.sh 60000 >data/transactions.csv \
    && ./build.sh >/dev/null && sha256sum build/balances.txt >balances.sha256 && rm -rf build
# The bug.
RUN sed -i 's|(\[a-z0-9-\]+)|([a-z]+)|' serve.pl
